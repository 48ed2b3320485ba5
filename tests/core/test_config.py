from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from dist_nce.core.config import ConfigError, absolute_paths, from_dict, load_config, to_dict


@dataclass
class Inner:
    lr: float = 1e-5
    mode: Literal["random", "hard", "mixed"] = "hard"


@dataclass
class Outer:
    name: str = "x"
    steps: int = 3
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)
    seed: Optional[int] = None


def test_roundtrip_and_types(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: y\nsteps: 5\ninner:\n  lr: 2e-5\n  mode: mixed\ntags: [a, b]\n")
    cfg = load_config(Outer, p, overrides=["inner.lr=5e-5", "seed=7"])
    assert cfg.inner.lr == pytest.approx(5e-5) and cfg.inner.mode == "mixed"
    assert cfg.tags == ["a", "b"] and cfg.seed == 7 and cfg.steps == 5
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_unknown_key_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: inner\.lrr: unknown key"):
        load_config(Outer, p)


def test_an_override_that_is_wrong_is_named_as_the_override(tmp_path):
    p = tmp_path / "good.yaml"
    p.write_text("inner:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=rf"^--set \(over {p}\): inner\.lrr: unknown key"):
        load_config(Outer, p, ["inner.lrr=2"])
    with pytest.raises(ConfigError, match=rf"^--set \(over {p}\): steps: expected an integer"):
        load_config(Outer, p, ["steps=many"])
    # what is wrong in the file stays the file's, whatever the overrides
    p.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"^{p}: inner\.lrr: unknown key"):
        load_config(Outer, p, ["steps=4"])


def test_wrong_type_and_literal():
    with pytest.raises(ConfigError, match=r"steps: expected an integer"):
        from_dict(Outer, {"steps": "many"})
    with pytest.raises(ConfigError, match=r"inner\.mode: 'soft' is not one of"):
        from_dict(Outer, {"inner": {"mode": "soft"}})


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Outer, "/nonexistent/x.yaml")


@dataclass
class _Where:
    store: str = ""
    uri: str = ""


@dataclass
class _Job:
    data: _Where = field(default_factory=_Where)
    out: str = ""


def test_absolute_paths_resolves_local_paths_and_leaves_uris_and_unset_ones(tmp_path):
    cfg = _Job(_Where("data/../kb", "s3://bucket/kb"), "")
    got = absolute_paths(cfg, ("data.store", "data.uri", "out"), str(tmp_path))
    assert got.data.store == str(tmp_path / "kb") and got.data.uri == "s3://bucket/kb" and got.out == ""
    assert cfg.data.store == "data/../kb"  # a copy: the caller's config is unchanged
    assert absolute_paths(_Job(_Where(str(tmp_path))), ("data.store",), "/elsewhere").data.store == str(tmp_path)
