"""Every shipped Zeshel config and rows file loads; the Zeshel config's checks and pieces."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_nce.core.config import ConfigError, from_dict, load_config, to_dict
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.train.config import TrainJobConfig
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute, check_zeshel_inputs, training_config
from dist_nce.zeshel.grid import labels, load_rows, row_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "zeshel"
RETRIEVER = sorted(p for p in CONFIGS.glob("*.yaml") if not p.stem.startswith("reranker") and "rows" not in p.stem)
RERANKER = sorted(CONFIGS.glob("reranker_*.yaml"))


@pytest.mark.parametrize("path", RETRIEVER, ids=lambda p: p.stem)
def test_retriever_configs_load(path):
    cfg = load_config(ZeshelRetrieverConfig, path)
    train = training_config(cfg)
    # What the Ray Train workers rebuild from the dict they receive: the same config, no zeshel section.
    assert type(train) is TrainJobConfig and from_dict(TrainJobConfig, to_dict(train)) == train
    assert cfg.data.dev_split.startswith(("train", "heldout_train"))


@pytest.mark.parametrize("path", RERANKER, ids=lambda p: p.stem)
def test_reranker_configs_load(path):
    cfg = load_config(RerankJobConfig, path)
    assert cfg.data.num_candidates >= 2 and cfg.model.reranker.max_len >= 9


@pytest.mark.parametrize("rows", sorted(CONFIGS.glob("*rows.yaml")), ids=lambda p: p.stem)
def test_rows_files(rows, tmp_path):
    base = CONFIGS / ("reranker_paper_gpu.yaml" if "table2" in rows.stem else
                      "retriever_paper_gpu.yaml" if "table1" in rows.stem else "retriever_tiny_cpu.yaml")
    for row in load_rows(rows):
        if "table2" in rows.stem:
            load_config(RerankJobConfig, base, list(row.overrides))
            continue
        cfg = row_config(base, row, tmp_path)
        assert cfg.run.output_dir == str(tmp_path / row.name) and Path(cfg.data.prepared_dir).is_absolute()
        arch, neg = labels(cfg)
        assert row.name.startswith(arch.replace("-", "")) and neg.replace("-", "") in row.name


def test_table1_rows_cover_the_grid():
    names = {r.name for r in load_rows(CONFIGS / "table1_rows.yaml")}
    assert {f"{a}_{n}" for a in ("dual", "poly16", "multi8", "som") for n in ("random", "hard", "mixed50")} == names


def test_rows_file_errors(tmp_path):
    bad = tmp_path / "rows.yaml"
    bad.write_text("rows:\n  - name: a\n    set: [x]\n")
    with pytest.raises(ConfigError, match=r"rows\[0\]: expected"):
        load_rows(bad)
    bad.write_text("rows:\n  - {name: a, set: []}\n  - {name: a, set: []}\n")
    with pytest.raises(ConfigError, match="used twice"):
        load_rows(bad)


def test_check_inputs_names_every_problem(tmp_path):
    cfg = absolute(load_config(ZeshelRetrieverConfig, CONFIGS / "test_tiny.yaml", [
        f"model.retriever.mention_model={tmp_path / 'no_model'}", f"data.prepared_dir={tmp_path / 'none'}",
        "zeshel.synthetic_entities_per_world=0", "data.synthetic_entities=10"]))
    with pytest.raises(ConfigError) as e:
        check_zeshel_inputs(cfg)
    msg = str(e.value)
    for key in ("data.prepared_dir", "model.retriever.mention_model", "AIDA inputs"):
        assert key in msg


def test_config_validation():
    with pytest.raises(ConfigError, match="train worlds"):
        load_config(ZeshelRetrieverConfig, CONFIGS / "test_tiny.yaml", ["data.dev_split=val"])
    with pytest.raises(ConfigError, match="run.export must be true"):
        load_config(ZeshelRetrieverConfig, CONFIGS / "test_tiny.yaml", ["run.export=false"])
    with pytest.raises(ConfigError, match="unknown worlds"):
        load_config(ZeshelRetrieverConfig, CONFIGS / "test_tiny.yaml", ["zeshel.synthetic_worlds=[narnia]"])
