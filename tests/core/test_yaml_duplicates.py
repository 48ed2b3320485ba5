"""A key repeated within one YAML mapping is refused (file:line and key path); merge keys still work."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dist_nce.core.config import ConfigError, UniqueKeyLoader, load_config, load_yaml
from dist_nce.zeshel.config import ZeshelRetrieverConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def duplicate_keys(paths: list[Path]) -> list[str]:
    """The duplicate-key errors of every document in ``paths`` (a Kubernetes file may hold several)."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            try:
                list(yaml.load_all(f, Loader=UniqueKeyLoader))
            except ConfigError as e:
                out.append(str(e))
    return out


def test_a_duplicate_top_level_section_is_refused_naming_file_line_and_key(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("optim:\n  lr: 0.1\n  epochs: 2\nrun:\n  name: a\noptim:\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert str(e.value) == f"{path}:6: duplicate key 'optim' (first at line 1)"
    with pytest.raises(ConfigError, match=r"x\.yaml:6: duplicate key 'optim' \(first at line 1\)"):
        load_config(ZeshelRetrieverConfig, path)  # the job loader, not only the helper


def test_a_duplicate_nested_key_is_refused_with_its_dotted_path(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("rows:\n  - name: a\n    set: []\n  - name: b\n    set: []\n    name: c\n"
                    "optim:\n  epochs: 1\n  lr: 0.1\n  epochs: 4\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert str(e.value) == f"{path}:6: duplicate key 'rows[1].name' (first at line 4)"
    path.write_text("optim:\n  epochs: 1\n  lr: 0.1\n  epochs: 4\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert str(e.value) == f"{path}:4: duplicate key 'optim.epochs' (first at line 2)"


def test_a_merge_key_may_be_overridden_by_an_explicit_key(tmp_path):
    path = tmp_path / "x.yaml"
    # ``inner`` is constructed after ``b`` has spliced its merged pairs into it: still no duplicate.
    path.write_text("base: &base {lr: 0.1, epochs: 2}\n"
                    "a:\n  inner: &inner\n    <<: *base\n    epochs: 3\n"
                    "b:\n  <<: *inner\n  lr: 0.5\n")
    assert load_yaml(path) == {"base": {"lr": 0.1, "epochs": 2}, "a": {"inner": {"lr": 0.1, "epochs": 3}},
                               "b": {"lr": 0.5, "epochs": 3}}
    path.write_text("base: &base {lr: 0.1}\nb:\n  <<: *base\n  lr: 0.5\n  lr: 0.6\n")
    with pytest.raises(ConfigError, match=r":5: duplicate key 'b.lr' \(first at line 4\)"):
        load_yaml(path)


def test_a_real_job_config_loads_as_before():
    path = CONFIGS / "zeshel" / "retriever_tiny_cpu.yaml"
    assert load_yaml(path) == yaml.safe_load(path.read_text())
    assert load_config(ZeshelRetrieverConfig, path).negatives.mode in ("random", "hard", "mixed")


def test_no_shipped_config_repeats_a_key(tmp_path):
    paths = sorted(CONFIGS.rglob("*.yaml"))
    assert len(paths) > 30 and duplicate_keys(paths) == []
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\n---\nb: 1\nb: 2\n")
    assert duplicate_keys([*paths[:2], bad]) == [f"{bad}:4: duplicate key 'b' (first at line 3)"]
