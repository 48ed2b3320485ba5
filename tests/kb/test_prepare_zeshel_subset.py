"""kb.prepare --zeshel-worlds / --zeshel-splits: a store of some worlds' documents and some splits.

The Zeshel retriever trains with negatives from the TRAINING worlds only, so its store
holds those worlds' documents and the mentions that link into them; val and test worlds
go to a second store.
"""
from __future__ import annotations

import numpy as np
import pytest

from kb.prepare import PrepareConfig, build_parser, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_zeshel

WORLDS = ["starwars", "military", "muppets", "lego"]  # 2 train, 1 val, 1 test


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_zeshel(tmp_path_factory.mktemp("zeshel_src"), WORLDS, 12, 10, seed=3)


def _prepare(root, out, tokenizer_dir, **kw):
    return prepare(PrepareConfig(out=str(out), zeshel_root=str(root), model_dir=tokenizer_dir, entity_max_len=24,
                                 mention_max_len=24, progress=False, **kw), log=lambda _: None)


def test_train_worlds_store(root, tmp_path, tiny_model_dir):
    m = _prepare(root, tmp_path / "train", tiny_model_dir, zeshel_worlds="train",
                 zeshel_splits="train,heldout_train_seen")
    store = EntityStore(tmp_path / "train")
    # "train" expands to the train worlds that have document files (the other 6 have none here)...
    assert set(store.world_ranges()) == {"starwars", "military"} and store.num_entities == 24
    assert sorted(m["mentions"]) == ["heldout_train_seen", "train"]
    assert m["spec"]["zeshel_worlds"][:2] == ["american_football", "doctor_who"]
    full = EntityStore(_full(root, tmp_path, tiny_model_dir))
    # ...and every train mention resolves to a row of its own world, as in a store of all worlds.
    for split in ("train", "heldout_train_seen"):
        t = MentionTable(tmp_path / "train", split)
        assert len(t) > 0 and (t.gold_rows >= 0).all()
        assert store.source_ids(t.gold_rows) == full.source_ids(MentionTable(full.path, split).gold_rows)
        assert store.worlds(t.gold_rows) == t.worlds


def _full(root, tmp_path, tokenizer_dir):
    _prepare(root, tmp_path / "full", tokenizer_dir)
    return tmp_path / "full"


def test_gold_outside_the_selected_worlds_is_counted_missing(root, tmp_path, tiny_model_dir):
    m = _prepare(root, tmp_path / "val_only", tiny_model_dir, zeshel_worlds="muppets", zeshel_splits="val,test")
    val, test = MentionTable(tmp_path / "val_only", "val"), MentionTable(tmp_path / "val_only", "test")
    assert (val.gold_rows >= 0).all() and (test.gold_rows == -1).all()
    assert m["mentions"]["test"]["gold"]["missing"] == len(test) > 0


def test_selection_is_part_of_the_spec(root, tmp_path, tiny_model_dir):
    from kb.prepare import PrepareError

    _prepare(root, tmp_path / "s", tiny_model_dir, zeshel_worlds="val,test", zeshel_splits="val,test")
    with pytest.raises(PrepareError, match="zeshel_splits"):
        _prepare(root, tmp_path / "s", tiny_model_dir, zeshel_worlds="val,test", zeshel_splits="val")
    store = EntityStore(tmp_path / "s")
    assert set(store.world_ranges()) == {"muppets", "lego"}
    assert np.array_equal(store.lengths(np.arange(len(store))) > 0, np.ones(len(store), bool))


def test_bad_selection(root, tmp_path):
    from dist_nce.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="unknown split"):
        from_dict(PrepareConfig, {"out": "x", "zeshel_root": "r", "zeshel_splits": "train,dev"})
    with pytest.raises(ConfigError, match="zeshel-worlds applies to --zeshel-root only"):
        from_dict(PrepareConfig, {"out": "x", "kilt_ks": "a", "zeshel_worlds": "train"})
    with pytest.raises(FileNotFoundError, match="mentions.*missing heldout_train_unseen"):
        missing = tmp_path / "m"
        (missing / "mentions").mkdir(parents=True)
        (missing / "documents").mkdir()
        (missing / "documents" / "lego.json").write_text((root / "documents" / "lego.json").read_text())
        prepare(PrepareConfig(out=str(tmp_path / "o"), zeshel_root=str(missing), zeshel_splits="heldout_train_unseen",
                              progress=False), log=lambda _: None)
    args = build_parser().parse_args(["--out", "o", "--zeshel-root", "r", "--zeshel-worlds", "val,starwars"])
    assert PrepareConfig(**vars(args)).zeshel_world_list == [
        "coronation_street", "elder_scrolls", "ice_hockey", "muppets", "starwars"]
