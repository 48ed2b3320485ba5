"""Training across a KB delta, the pure parts: the driver's control file, a worker following the KB version.

(The service side of a delta is tested on real shards in tests/actors/test_live_service.py.)
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from dist_nce.train.kb_control import DONE_FILE, FAILED_FILE, CONTROL_FILE, KbWatcher, apply_request, request_update
from dist_nce.train.kb_follow import KbFollower
from kb.delta import UpdateConfig, update
from kb.store import EntityStore

from kb_delta_helpers import entities, prepare_store  # noqa: E402  (tests/ is on sys.path)


class FakeService:
    """What the control file and the follower use of a NegativeService."""

    def __init__(self, store: str | None = None, fail: bool = False):
        self.store, self.fail, self.kb_version, self.calls = store, fail, 0, []

    def apply_delta(self, kb_version=None):
        self.calls.append(kb_version)
        if self.fail:
            raise ValueError("no shard holds the served weights")
        self.kb_version = EntityStore(self.store).kb_version if self.store else (kb_version or 1)
        return 7

    def sync_kb(self):
        return self.kb_version


def test_control_file_round_trip(tmp_path):
    service = FakeService()
    assert apply_request(service, tmp_path) is None and not service.calls
    request_update(tmp_path, 2)
    out = apply_request(service, tmp_path)
    assert service.calls == [2] and out["index_version"] == 7 and out["served_kb_version"] == 2
    assert not (tmp_path / CONTROL_FILE).exists() and json.loads((tmp_path / DONE_FILE).read_text())["kb_version"] == 2
    request_update(tmp_path)
    out = apply_request(FakeService(fail=True), tmp_path)
    assert "no shard holds" in out["error"] and (tmp_path / FAILED_FILE).exists()
    with pytest.raises(ValueError):
        request_update(tmp_path, -1)


def test_the_watcher_applies_a_request_while_running(tmp_path):
    service = FakeService()
    with KbWatcher(service, tmp_path, interval_s=0.05, log=lambda s: None) as watcher:
        request_update(tmp_path, 1)
        deadline = time.monotonic() + 10
        while not watcher.outcomes:
            assert time.monotonic() < deadline, "the watcher never applied the request"
            time.sleep(0.02)
    assert service.calls == [1] and watcher.outcomes[0]["index_version"] == 7


def test_a_worker_follows_the_kb_and_skips_golds_a_delta_changed(tmp_path, tiny_model_dir):
    base = list(range(1000, 1030))
    golds = [1003, 1007, 1012, 1020]  # removed, replaced, untouched, untouched
    store = prepare_store(tmp_path, "store", entities(base), tiny_model_dir, golds)
    service = FakeService(str(store))
    follower = KbFollower(service, str(store), "train")
    mined_gold = torch.as_tensor(follower.gold[np.arange(4)])
    assert mined_gold.tolist() == [3, 7, 12, 20] and not follower.follow(0)

    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities([1007, 2000], seed=3).values()))
    (tmp_path / "rm.txt").write_text("1003\n1007\n")
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], remove=str(tmp_path / "rm.txt"),
                        model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    assert not follower.follow(0), "an answer of an index version already seen changes nothing"
    service.apply_delta()
    assert follower.follow(1) and follower.kb_version == 1
    assert follower.store.num_entities == 32  # the appended rows can now be gathered as negatives
    assert follower.gold[:4].tolist() == [-1, 30, 12, 20]  # 1007 replaced: the first added row
    assert follower.mining_gold[:4].tolist() == [3, 30, 12, 20]  # a removed gold stays excluded when mining
    # batches mined before the delta: the removed gold and the replaced one are skipped
    assert follower.keep(np.arange(4), mined_gold).tolist() == [False, False, True, True]
    # batches mined after it, with the followed golds: the replacement is trained on
    assert follower.keep(np.arange(4), torch.as_tensor(follower.mining_gold[:4])).tolist() == [False, True, True, True]


def test_the_run_says_which_mentions_a_changed_kb_leaves_out_of_its_plan(tmp_path, tiny_model_dir):
    """The data order comes from the golds as prepared (resumed runs replay it), so a gold a delta added
    (missing at prepare) is not trained on: said before the run starts, with the way to train on it."""
    from dist_nce.train.config import TrainJobConfig
    from dist_nce.train.trainer import kb_delta_note

    golds = [1003, 1007, 1012, 2001, 2002]  # removed; replaced; untouched; missing at prepare, added by the delta
    store = prepare_store(tmp_path, "store", entities(range(1000, 1030)), tiny_model_dir, golds)
    cfg = TrainJobConfig()
    cfg.data.prepared_dir = str(store)
    assert kb_delta_note(cfg) == ""  # version 0
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities([1007, 2001, 2002], seed=3).values()))
    (tmp_path / "rm.txt").write_text("1003\n1007\n")
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], remove=str(tmp_path / "rm.txt"),
                        model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    assert kb_delta_note(cfg) == (
        "KB version 1: training mentions whose gold a delta added, not trained on (counted as excluded above): 2; "
        "whose gold a delta removed, skipped when their batch comes: 1. The data order comes from the "
        "golds as prepared, so that resumed runs replay it; to train on the KB as it is now, compact it "
        f"(jobs/update_kb.py --store {store} --compact --out DIR) and train on DIR")
    # the first 3 mentions only (data.max_train_mentions): none a delta added
    cfg.data.max_train_mentions = 3
    assert kb_delta_note(cfg).startswith("KB version 1: training mentions whose gold a delta removed, skipped when "
                                         "their batch comes: 1. ")
