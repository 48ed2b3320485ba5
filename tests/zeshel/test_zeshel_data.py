"""The Zeshel stores of a run: synthetic tree generated once, reused, and generated (and
prepared) again when its settings change; real stores are checked, never overwritten."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_nce.core.config import load_config
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


def test_two_stores_then_reuse_then_regenerate_for_other_settings(tmp_path, tiny_model_dir):
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
    old_manifest = (Path(train) / "manifest.json").read_bytes()

    changed: list[str] = []
    assert ensure_zeshel_stores(config(tmp_path, tiny_model_dir, "zeshel.synthetic_mentions_per_world=11",
                                       "zeshel.synthetic_eval_mentions_per_world=7"), changed.append) == \
        (train, evaluation)
    assert any("differs in: mentions_per_world" in line for line in changed)
    assert sum("prepared from other inputs" in line for line in changed) == 2  # both stores, not reused stale
    assert len(MentionTable(evaluation, "val")) == 2 * 7
    assert (Path(train) / "manifest.json").read_bytes() != old_manifest


def test_given_stores_without_a_tree_are_checked_not_rebuilt(tmp_path, tiny_model_dir):
    train, evaluation = ensure_zeshel_stores(config(tmp_path, tiny_model_dir), lambda _m: None)
    given = config(tmp_path, tiny_model_dir, "zeshel.synthetic_entities_per_world=0")
    assert ensure_zeshel_stores(given, lambda _m: None) == (train, evaluation)
    with pytest.raises(ValueError, match=r"data.entity_max_len is 16 but the store .*train was prepared with 32"):
        ensure_zeshel_stores(config(tmp_path, tiny_model_dir, "zeshel.synthetic_entities_per_world=0",
                                    "data.entity_max_len=16"))


def test_a_training_store_holding_val_or_test_worlds_is_refused(tmp_path, tiny_model_dir):
    """A store prepared from the whole tree (prepare_kb.py --zeshel-root, no --zeshel-worlds) given as the
    training store: its val/test worlds' entities would be the negatives the retriever learns from."""
    from dist_nce.core.config import ConfigError
    from dist_nce.zeshel.config import check_zeshel_inputs
    from kb.prepare import PrepareConfig, prepare

    ensure_zeshel_stores(config(tmp_path, tiny_model_dir), lambda _m: None)  # the synthetic tree, both stores
    prepare(PrepareConfig(out=str(tmp_path / "whole"), zeshel_root=str(tmp_path / "src"), model_dir=tiny_model_dir,
                          mention_max_len=32, entity_max_len=32, progress=False), log=lambda s: None)
    assert "muppets" in EntityStore(tmp_path / "whole").world_ranges()
    given = config(tmp_path, tiny_model_dir, "zeshel.synthetic_entities_per_world=0",
                   f"data.prepared_dir={tmp_path / 'whole'}")
    said = "data.prepared_dir: .*whole holds the entities of val/test worlds \\(ice_hockey, muppets, lego\\)"
    with pytest.raises(ConfigError, match=said):
        check_zeshel_inputs(given)  # so --dry-run says it
    with pytest.raises(ConfigError, match=said + ".*--zeshel-worlds train"):
        ensure_zeshel_stores(given, lambda _m: None)
    check_zeshel_inputs(config(tmp_path, tiny_model_dir, "zeshel.synthetic_entities_per_world=0"))  # train alone


def test_a_tree_without_any_of_the_mention_splits_is_a_clear_error(tmp_path, tiny_model_dir):
    from dist_nce.core.config import ConfigError
    from dist_nce.zeshel.data import prepare_store

    (tmp_path / "tree" / "mentions").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"no mentions/\{val,test\}.json: the val,test worlds' store needs"):
        prepare_store(str(tmp_path / "tree"), str(tmp_path / "out"), "val,test", ("val", "test"),
                      config(tmp_path, tiny_model_dir))
    assert not (tmp_path / "out").exists()


def test_a_malformed_line_of_a_given_tree_names_the_key_that_skips_it(tmp_path, tiny_model_dir):
    import shutil

    ensure_zeshel_stores(config(tmp_path, tiny_model_dir), lambda _m: None)  # writes the synthetic tree
    tree = tmp_path / "tree"
    shutil.copytree(tmp_path / "src", tree)
    train = tree / "mentions" / "train.json"
    lines = train.read_text().splitlines()
    lines[3] = lines[3][:15]
    train.write_text("\n".join(lines) + "\n")
    sets = ["zeshel.synthetic_entities_per_world=0", f"data.zeshel_root={tree}",
            f"data.prepared_dir={tmp_path / 'given_train'}", f"zeshel.eval_store={tmp_path / 'given_eval'}"]
    with pytest.raises(ValueError, match=rf"(?s){train}:4: not JSON.*set data.on_bad_record=skip"):
        ensure_zeshel_stores(config(tmp_path, tiny_model_dir, *sets), lambda _m: None)
    got, _ = ensure_zeshel_stores(config(tmp_path, tiny_model_dir, *sets, "data.on_bad_record=skip"),
                                  lambda _m: None)
    assert EntityStore(got).manifest["skipped"]["count"] == 1
    assert len(MentionTable(got, "train")) == len(lines) - 1


def test_dry_run_refuses_a_store_the_run_would_refuse_to_prepare_over(tmp_path, tiny_model_dir):
    """A user's tree (data.zeshel_root) prepared with data.on_bad_record=skip, then the same command without
    it: the run refuses the stores (prepared from other settings), so --dry-run must not say OK. A synthetic
    tree's stores are prepared again instead, so nothing is refused there."""
    from dist_nce.cli.zeshel_retriever import _check_existing_store
    from dist_nce.core.config import ConfigError
    from dist_nce.zeshel.data import store_conflicts

    ensure_zeshel_stores(config(tmp_path, tiny_model_dir), lambda _m: None)  # generates the tree in src/
    real = ["zeshel.synthetic_entities_per_world=0", f"data.zeshel_root={tmp_path / 'src'}",
            f"data.prepared_dir={tmp_path / 'own_train'}", f"zeshel.eval_store={tmp_path / 'own_eval'}"]
    ensure_zeshel_stores(config(tmp_path, tiny_model_dir, *real, "data.on_bad_record=skip"), lambda _m: None)
    assert store_conflicts(config(tmp_path, tiny_model_dir, *real, "data.on_bad_record=skip")) == []
    _check_existing_store(config(tmp_path, tiny_model_dir, *real, "data.on_bad_record=skip"))  # OK, as the run
    said = store_conflicts(config(tmp_path, tiny_model_dir, *real))
    assert said == [f"{key}: {tmp_path / s} already holds a prepared store from other inputs (differs in: "
                    "on_bad_record); replace it (kb.prepare --overwrite) or prepare into another directory: "
                    f"{key}=<another directory> to keep it"
                    for key, s in (("data.prepared_dir", "own_train"), ("zeshel.eval_store", "own_eval"))], said
    with pytest.raises(ConfigError, match="differs in: on_bad_record"):
        _check_existing_store(config(tmp_path, tiny_model_dir, *real))  # the job's --dry-run hook
    with pytest.raises(ValueError, match="differs in: on_bad_record"):  # what the run says
        ensure_zeshel_stores(config(tmp_path, tiny_model_dir, *real), lambda _m: None)
    assert store_conflicts(config(tmp_path, tiny_model_dir, "data.on_bad_record=skip")) == []  # synthetic
