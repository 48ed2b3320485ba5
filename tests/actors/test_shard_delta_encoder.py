"""A shard encodes KB deltas with the encoder it holds: built once per actor, never rebuilt or
re-shipped per delta; a shard reloaded from disk gets one from ``hold_encoder`` before any
delta arrives (EntityShard as a plain object, as tests/actors/test_shard.py does)."""
from __future__ import annotations

import shutil

import pytest

from dist_nce.index.encode import state_fingerprint
from kb.delta import UpdateConfig, update
from kb.store import EntityStore

from kb_delta_helpers import entities  # noqa: E402  (tests/ is on sys.path)
from tests.actors.test_shard import GOLD, QUERIES, make_shard, states  # noqa: E402,F401  (tests/index is on sys.path; states: a fixture)

N = 60


class Unfetchable(list):
    """A boxed state ([ObjectRef]) that fails the test if a shard reaches into it."""

    def __init__(self):
        super().__init__([None])

    def __getitem__(self, i):
        raise AssertionError("the shard fetched the state although it holds those weights")


@pytest.fixture()
def store(tmp_path, tiny_model_dir):
    from kb_delta_helpers import prepare_store

    return prepare_store(tmp_path, "store", entities(range(1000, 1000 + N)), tiny_model_dir, golds=[1000, 1001])


def add_rows(store, tmp_path, model_dir, ids, remove=()) -> tuple[int, int]:
    """One kb.delta run adding ``ids`` (and removing ``remove``); the new rows' range."""
    before = EntityStore(store).num_entities
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities(ids, seed=ids[0]).values()))
    cfg = {"store": str(store), "add": [str(tmp_path / "add.json")], "model_dir": model_dir, "progress": False}
    if remove:
        (tmp_path / "rm.txt").write_text("".join(f"{w}\n" for w in remove))
        cfg["remove"] = str(tmp_path / "rm.txt")
    update(UpdateConfig(**cfg), log=lambda s: None)
    return before, EntityStore(store).num_entities


def same_answers(a, b):
    for q in (QUERIES, QUERIES * 2):
        x, y = a.topk(q, 8, GOLD), b.topk(q, 8, GOLD)
        assert x.version == y.version and x.ids.tolist() == y.ids.tolist() and x.scores.tolist() == y.scores.tolist()


def test_a_reloaded_shard_holds_its_encoder_before_the_delta(store, tmp_path, tiny_model_dir, states):
    fp = state_fingerprint(states[0])
    encoded = make_shard(str(store), tmp_path / "encoded", rows=(0, N), shard=0)
    assert encoded.refresh(states[0], 0) == 0
    shutil.copytree(tmp_path / "encoded", tmp_path / "reloaded")
    reloaded = make_shard(str(store), tmp_path / "reloaded", rows=(0, N), shard=0)
    assert reloaded.status()["source"] == "reloaded" and reloaded.status()["encoder_held"] is None

    first = add_rows(store, tmp_path, tiny_model_dir, list(range(5000, 5012)), remove=[1003])
    with pytest.raises(ValueError, match="weights of the version served"):  # nothing held, nothing given
        reloaded.apply_delta(None, 1, 1, [first])
    assert reloaded.hold_encoder(states[0], fp) == fp and reloaded.status()["encoder_held"] == fp
    encoder = reloaded._encoder
    assert reloaded.hold_encoder(Unfetchable(), fp) == fp, "held already: not fetched again"

    assert reloaded.apply_delta(Unfetchable(), 1, 1, [first]) == 1
    assert encoded.apply_delta(states[0], 1, 1, [first]) == 1
    same_answers(reloaded, encoded)

    second = add_rows(store, tmp_path, tiny_model_dir, list(range(6000, 6007)))
    assert reloaded.apply_delta(Unfetchable(), 2, 2, [second]) == 2
    assert encoded.apply_delta([states[0]], 2, 2, [second]) == 2  # a box holding the state itself
    assert reloaded._encoder is encoder and reloaded.status()["encoder_held"] == fp, "built once per actor"
    same_answers(reloaded, encoded)
    st = reloaded.status()
    assert (st["served"], st["kb_version"], st["pieces"]) == (2, 2, [[0, N], list(first), list(second)])


def test_other_weights_are_not_used_for_a_delta(store, tmp_path, tiny_model_dir, states):
    shard = make_shard(str(store), tmp_path / "run", rows=(0, N), shard=0)
    assert shard.refresh(states[0], 0) == 0
    shard.hold_encoder(states[1])  # holds other weights than the version served
    rows = add_rows(store, tmp_path, tiny_model_dir, list(range(5000, 5004)))
    with pytest.raises(ValueError, match="weights of the version served.*another one"):
        shard.apply_delta([states[1]], 1, 1, [rows])
    assert shard.apply_delta([states[0]], 1, 1, [rows]) == 1
    assert shard.status()["encoder_held"] == state_fingerprint(states[0])


def test_a_static_shape_shard_encodes_every_delta_in_its_refresh_batch(store, tmp_path, tiny_model_dir, states,
                                                                       monkeypatch):
    """A GPU shard's layers are compiled for static shapes (index/encode.py compile_encoder): a delta of
    k rows used to run in batches of k, a new graph family per delta size (past dynamo's limit of 8,
    eager). Its batches are now filled up to the refresh's batch (8 here), in deltas and in the full
    refresh that re-encodes the appended ranges, and the answers are the uncompiled shard's."""
    import torch

    import dist_nce.actors.shard as shard_module
    from tests.index.test_encode import spy_compile

    real = shard_module.prepare_encoder
    monkeypatch.setattr(shard_module, "prepare_encoder", lambda *a, **kw: real(*a, **{**kw, "layers": True}))
    seen = spy_compile(monkeypatch)  # records the (batch, length, d) every compiled layer sees
    static = make_shard(str(store), tmp_path / "static", rows=(0, N), shard=0, encode_compile=True)
    plain = make_shard(str(store), tmp_path / "plain", rows=(0, N), shard=0, encode_compile=False)
    for shard in (static, plain):
        assert shard.refresh(states[0], 0) == 0
    assert seen and {shape[0] for shape, _ in seen} == {8}
    seen.clear()
    for version, ids in ((1, range(5000, 5003)), (2, range(6000, 6011))):  # 3 rows, then 11 (8 + 3)
        rows = add_rows(store, tmp_path, tiny_model_dir, list(ids))
        for shard in (static, plain):
            assert shard.apply_delta(states[0], version, version, [rows]) == version
    from dist_nce.index.encode import transformer_layers

    layers = len(transformer_layers(static._encoder))
    assert len(seen) == 3 * layers and {shape[0] for shape, _ in seen} == {8}  # 1 batch + 2 batches
    seen.clear()
    for shard in (static, plain):  # a full refresh: the shard's rows, then each appended range
        assert shard.refresh(states[1], 3) == 3
    assert {shape[0] for shape, _ in seen} == {8}
    for q in (QUERIES, QUERIES * 2):
        x, y = static.topk(q, 8, GOLD), plain.topk(q, 8, GOLD)
        assert x.version == y.version == 3 and x.ids.tolist() == y.ids.tolist()
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-5, atol=1e-5)


def test_a_delta_asked_again_under_a_new_number_is_served_again_without_encoding(store, tmp_path, tiny_model_dir,
                                                                                 states):
    """A delta that failed on another shard is asked for again under a new version number (actors.sequencer):
    a shard that applied it serves it again as that number, with nothing encoded and the same answers. It
    used to refuse it ("overlap"), so a delta that failed on some shards could never be applied."""
    shard = make_shard(str(store), tmp_path / "run", rows=(0, N), shard=0)
    assert shard.refresh(states[0], 0) == 0
    rows = add_rows(store, tmp_path, tiny_model_dir, list(range(5000, 5006)), remove=[1004])
    assert shard.apply_delta([states[0]], 1, 1, [rows]) == 1
    before, encodes = shard.topk(QUERIES, 8, GOLD), shard.status()["encodes"]
    assert shard.apply_delta(Unfetchable(), 2, 1, [rows]) == 2
    after, st = shard.topk(QUERIES, 8, GOLD), shard.status()
    assert (st["served"], st["kb_version"], st["pieces"]) == (2, 1, [[0, N], list(rows)])
    assert st["encodes"] == encodes + 1 and after.version == 2  # a new version, no row encoded (Unfetchable)
    assert after.ids.tolist() == before.ids.tolist() and after.scores.tolist() == before.scores.tolist()
    reloaded = make_shard(str(store), tmp_path / "run", rows=(0, N), shard=0)  # persisted as a whole version
    again = reloaded.topk(QUERIES, 8, GOLD)
    assert again.version == 2 and again.ids.tolist() == before.ids.tolist()
    with pytest.raises(ValueError, match="overlap"):  # other rows over the ones it owns are still refused
        shard.apply_delta(Unfetchable(), 3, 1, [(rows[0], rows[1] + 1)])
