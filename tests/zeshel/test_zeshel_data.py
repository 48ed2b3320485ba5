"""The Zeshel stores of a run: synthetic tree generated once, refused when generated otherwise."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_nce.config import load_config
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute
from dist_nce.zeshel.data import ensure_zeshel_stores
from kb.store import EntityStore, MentionTable

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "test_tiny.yaml"


def config(tmp_path, tokenizer_dir, *extra):
    return absolute(load_config(ZeshelRetrieverConfig, CONFIG, [
        f"model.retriever.mention_model={tokenizer_dir}", f"data.prepared_dir={tmp_path / 'train'}",
        f"zeshel.eval_store={tmp_path / 'eval'}", f"zeshel.synthetic_dir={tmp_path / 'src'}",
        "zeshel.synthetic_entities_per_world=20", "zeshel.synthetic_mentions_per_world=10",
        "zeshel.synthetic_eval_mentions_per_world=6", *extra]))


def test_two_stores_then_reuse_then_refuse_other_settings(tmp_path, tiny_model_dir):
    logged: list[str] = []
    train, evaluation = ensure_zeshel_stores(config(tmp_path, tiny_model_dir), logged.append)
    assert set(EntityStore(train).world_ranges()) == {"starwars", "military"}
    assert set(EntityStore(evaluation).world_ranges()) == {"muppets", "ice_hockey", "lego"}
    assert sorted(EntityStore(train).manifest["mentions"]) == ["heldout_train_seen", "heldout_train_unseen", "train"]
    val = MentionTable(evaluation, "val")
    assert (val.gold_rows >= 0).all() and len(val) == 2 * 6  # val/test worlds get the eval mention count
    assert any("generating synthetic Zeshel" in line for line in logged)
    again: list[str] = []
    assert ensure_zeshel_stores(config(tmp_path, tiny_model_dir), again.append) == (train, evaluation)
    assert again == []  # nothing generated or prepared twice
    with pytest.raises(ValueError, match="differs in: mentions_per_world"):
        ensure_zeshel_stores(config(tmp_path, tiny_model_dir, "zeshel.synthetic_mentions_per_world=11"))
