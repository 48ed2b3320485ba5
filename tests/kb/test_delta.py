"""KB deltas (kb.delta): add, remove, replace entities in a prepared store; versions; compaction.

Every check compares the delta'd store with a store prepared from scratch from the final
entity set (by source id: the row ids differ, the content must not).
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import kb.delta as delta
from dist_nce.core.records import BadRecord
from dist_nce.index.encode import store_fingerprint
from kb.delta import UpdateConfig, compact, update
from kb.prepare_config import PrepareError
from kb.store import GOLD_REMOVED, EntityStore, MentionTable

from kb_delta_helpers import entities, kilt_line, prepare_store  # noqa: E402  (tests/ is on sys.path)

N = 40


BASE = list(range(1000, 1000 + N))
REMOVED = [1003, 1005, 1010]
REPLACED = [1007]
ADDED = [2000, 2001, 2002, 2003, 2004]
GOLDS = [1003, 1007, 1012, 2001]  # removed, replaced, untouched, missing at prepare time


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("delta")
    base_lines = entities(BASE)
    store = prepare_store(root, "store", base_lines, tiny_model_dir, GOLDS)
    fingerprint = store_fingerprint(str(store))
    new_lines = {**entities(ADDED, seed=1), **entities(REPLACED, seed=2, prefix="Renamed")}
    (root / "add.json").write_text("".join(v + "\n" for v in new_lines.values()))
    (root / "remove.txt").write_text("\n".join(str(w) for w in REMOVED + REPLACED) + "\n\n")
    record = update(UpdateConfig(store=str(store), add=[str(root / "add.json")], remove=str(root / "remove.txt"),
                                 model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    final = {w: line for w, line in base_lines.items() if w not in REMOVED + REPLACED}
    final.update(new_lines)
    scratch = prepare_store(root, "scratch", final, tiny_model_dir, GOLDS)
    return {"root": root, "store": store, "scratch": scratch, "record": record, "fingerprint": fingerprint,
            "model": tiny_model_dir}


def by_source(store: EntityStore) -> dict[str, tuple]:
    live = np.flatnonzero(store.is_live(np.arange(store.num_entities)))
    return {sid: (title, tuple(tok)) for sid, title, tok in
            zip(store.source_ids(live), store.titles(live), store.token_ids(live).tolist())}


def test_delta_record_and_rows(stores):
    rec = stores["record"]
    assert (rec["version"], rec["added"], rec["removed"], rec["replaced"]) == (1, 6, 4, 1)
    assert (rec["count"], rec["live"]) == (N + 6, N + 6 - 4)
    assert rec["segment"]["rows"] == [N, N + 6]
    store = EntityStore(stores["store"])
    assert store.kb_version == 1 and store.num_entities == N + 6 and store.num_live == N + 2
    rows = store.rows_for_source_ids([str(w) for w in REMOVED + REPLACED + ADDED + [1012, 999]])
    assert (rows[:3] == -1).all()
    assert rows[3] == N + 5 and store.titles([rows[3]]) == ["Renamed 1007"]  # replaced: its new row
    assert rows[4:9].tolist() == list(range(N, N + 5))  # appended in file order
    assert rows[9] == 12 and rows[10] == -1
    assert store.tombstones.tolist() == [3, 5, 7, 10]
    assert store.rows_for_titles(["Page 1003", "Renamed 1007", "Page 1007"]).tolist() == [-1, rows[3], -1]
    # Row ids never move: rows of version 0 read the same, tombstoned or not.
    old = EntityStore(stores["store"], kb_version=0)
    assert old.num_entities == N and old.num_live == N
    assert old.rows_for_source_ids(["1003", "1007"]).tolist() == [3, 7]
    assert store.token_ids(np.arange(N)).tolist() == old.token_ids(np.arange(N)).tolist()
    # The lineage fingerprint survives the delta: persisted shard embeddings stay valid.
    assert store_fingerprint(str(stores["store"])) == stores["fingerprint"]


def test_delta_equals_scratch_store(stores):
    assert by_source(EntityStore(stores["store"])) == by_source(EntityStore(stores["scratch"]))


def test_slices_and_batches_cross_the_segment(stores):
    store = EntityStore(stores["store"])
    view = store.slice(N - 3, N + 4)
    rows, tokens, lengths = zip(*view.iter_batches(5))
    assert np.concatenate(rows).tolist() == list(range(7))
    assert np.concatenate(tokens).tolist() == store.token_ids(np.arange(N - 3, N + 4)).tolist()
    assert view.tombstones.tolist() == []
    assert store.slice(0, 8).tombstones.tolist() == [3, 5, 7]


def test_mention_golds_follow_the_version(stores):
    table = MentionTable(stores["store"], "train")
    store = EntityStore(stores["store"])
    gold = table.gold_rows
    assert gold[0] == -1 and table.gold_status[0] == GOLD_REMOVED  # removed for good
    assert gold[1] == store.rows_for_source_ids(["1007"])[0] >= N  # follows its replacement
    assert gold[2] == 12
    assert gold[3] == store.rows_for_source_ids(["2001"])[0] and table.gold_status[3] == "id"  # added later
    assert MentionTable(stores["store"], "train", kb_version=0).gold_rows.tolist() == [3, 7, 12, -1]
    assert stores["record"]["mentions"]["train"] == {"unresolvable": 1, "moved": 1, "resolved": 1,
                                                     "removed_total": 1, "resolved_total": 3}


def test_compact_is_a_fresh_store_equal_to_scratch(stores):
    out = stores["root"] / "compacted"
    compact(UpdateConfig(store=str(stores["store"]), compact=True, out=str(out), progress=False), log=lambda s: None)
    packed, scratch = EntityStore(out), EntityStore(stores["scratch"])
    assert packed.kb_version == 0 and packed.num_entities == packed.num_live == N + 2
    assert by_source(packed) == by_source(scratch)
    store = EntityStore(stores["store"])
    live = np.flatnonzero(store.is_live(np.arange(store.num_entities)))
    assert packed.source_ids(np.arange(packed.num_entities)) == store.source_ids(live)  # live rows, in row order
    gold = MentionTable(out, "train").gold_rows
    assert packed.source_ids(gold[gold >= 0]) == ["1007", "1012", "2001"]
    assert store_fingerprint(str(out)) != stores["fingerprint"]


def _second_store(stores, name):
    root = stores["root"]
    return prepare_store(root, name, entities(BASE), stores["model"], golds=[1001])


def test_bad_records_are_reported_with_file_and_line(stores):
    root, model = stores["root"], stores["model"]
    store = _second_store(stores, "bad")
    rng = random.Random(5)
    (root / "bad_add.json").write_text(kilt_line(3000, "New", rng) + "\n{not json\n" + kilt_line(1001, "Dup", rng)
                                       + "\n" + kilt_line(3000, "Twice", rng) + "\n")
    (root / "bad_rm.txt").write_bytes(b"\xef\xbb\xbf1002\n4242\n1002\n")  # a byte order mark: the first id is 1002
    cfg = dict(store=str(store), model_dir=model, progress=False)
    with pytest.raises(BadRecord, match=r"bad_add.json:2: not JSON"):
        update(UpdateConfig(add=[str(root / "bad_add.json")], **cfg), log=lambda s: None)
    with pytest.raises(BadRecord, match=r"bad_rm.txt:2: source id '4242' is not in the KB"):
        update(UpdateConfig(remove=str(root / "bad_rm.txt"), **cfg), log=lambda s: None)
    assert EntityStore(store).kb_version == 0  # nothing written by a failed update
    rec = update(UpdateConfig(add=[str(root / "bad_add.json")], remove=str(root / "bad_rm.txt"),
                              on_bad_record="skip", **cfg), log=lambda s: None)
    reasons = sorted((r["path"].rsplit("/", 1)[1], r["line"], r["reason"].split(" (")[0])
                     for r in rec["skipped"]["records"])
    assert rec["skipped"]["count"] == 5
    assert reasons[0][:2] == ("bad_add.json", 2)
    assert ("bad_add.json", 3) in [r[:2] for r in reasons] and "already in the KB" in str(rec["skipped"])
    assert ("bad_add.json", 4) in [r[:2] for r in reasons] and "duplicate source id" in str(rec["skipped"])
    assert ("bad_rm.txt", 2) in [r[:2] for r in reasons] and ("bad_rm.txt", 3) in [r[:2] for r in reasons]
    assert (rec["added"], rec["removed"]) == (1, 1)


def test_killed_update_leaves_the_previous_version(stores, monkeypatch, capsys):
    root, model = stores["root"], stores["model"]
    store = _second_store(stores, "killed")
    (root / "k_add.json").write_text(kilt_line(5000, "Late", random.Random(1)) + "\n")
    cfg = UpdateConfig(store=str(store), add=[str(root / "k_add.json")], model_dir=model, progress=False)

    def die(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(delta, "atomic_write_json", die)  # killed just before the manifest
    with pytest.raises(KeyboardInterrupt):
        update(cfg, log=lambda s: None)
    # Ctrl-C in jobs/update_kb.py: what happened and what to do, as prepare_kb says it, not a traceback
    capsys.readouterr()
    argv = ["--store", str(store), "--add", str(root / "k_add.json"), "--model-dir", model, "--no-progress"]
    assert delta.main(argv) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"interrupted: {store} is still at its last version; the encoded chunks of this update are kept in "
        f"{store.resolve() / 'versions'}; run the same command again to resume")
    monkeypatch.undo()
    assert EntityStore(store).kb_version == 0 and EntityStore(store).rows_for_source_ids(["5000"]).tolist() == [-1]
    assert update(cfg, log=lambda s: None)["version"] == 1  # the same command again
    assert EntityStore(store).rows_for_source_ids(["5000"]).tolist() == [N]


def test_nothing_to_do_and_compact_checks(stores):
    with pytest.raises(PrepareError, match="nothing to do"):
        UpdateConfig(store=str(stores["store"])).validate()
    with pytest.raises(PrepareError, match="--out"):
        UpdateConfig(store=str(stores["store"]), compact=True).validate()
