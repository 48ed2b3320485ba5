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

    def sync_kb(self, kb_version=None):
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
    assert not (tmp_path / DONE_FILE).exists(), "the earlier request's outcome is not this one's"
    request_update(tmp_path, 3)
    apply_request(service, tmp_path)
    assert (tmp_path / DONE_FILE).exists() and not (tmp_path / FAILED_FILE).exists()
    with pytest.raises(ValueError):
        request_update(tmp_path, -1)


def test_the_command_refuses_a_run_directory_that_is_not_there_and_a_negative_version(tmp_path, capsys):
    from dist_nce.train.kb_control import main

    assert main([str(tmp_path / "typo")]) == 2 and not (tmp_path / "typo").exists()
    assert "run_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--kb-version", "-1"])
    assert e.value.code == 2 and "--kb-version: must be >= 0" in capsys.readouterr().err
    assert main([str(tmp_path), "--kb-version", "2"]) == 0 and (tmp_path / CONTROL_FILE).exists()


def test_a_request_the_shards_cannot_take_yet_is_said_once_and_kept(tmp_path):
    """Shards reloaded from disk hold no encoder with the weights they serve until the next refresh: the
    request is kept and tried at each poll, and said once (it used to log a traceback every 5 s)."""
    class NotYet(FakeService):
        def apply_delta(self, kb_version=None):
            self.calls.append(kb_version)
            raise ValueError("shard 1: a KB delta must be encoded with the weights of the version served (121)")

    said = []
    watcher = KbWatcher(NotYet(), tmp_path, log=said.append)
    request_update(tmp_path, 2)
    for _ in range(3):
        assert watcher.poll()["retry"]
    assert (tmp_path / CONTROL_FILE).exists() and len(said) == 1 and "kept" in said[0], said
    assert said[0].startswith("KB update: ValueError: shard 1: a KB delta must be encoded with the weights")


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


def test_a_run_trains_on_the_golds_of_the_kb_version_it_starts_at(tmp_path, tiny_model_dir):
    """A fresh run's data order comes from the golds of the store's current KB version: a gold a delta added
    before it (missing at prepare) is trained on, one a delta removed is left out of the plan. A run that
    started before those deltas keeps its order (it resumes exactly) and says what a later delta left out."""
    from dist_nce.train.config import TrainJobConfig
    from dist_nce.train.trainer import kb_delta_note, plan_for

    golds = [1003, 1007, 1012, 2001, 2002]  # removed; replaced; untouched; missing at prepare, added by the delta
    store = prepare_store(tmp_path, "store", entities(range(1000, 1030)), tiny_model_dir, golds)
    cfg = TrainJobConfig()
    cfg.data.prepared_dir = str(store)
    cfg.optim.batch_size = 1
    cfg.negatives.num_candidates = 4
    cfg.run.storage_path = str(tmp_path / "ray")  # no checkpoint there: a fresh run
    before = plan_for(cfg)
    assert kb_delta_note(cfg) == "" and before.order_kb_version == 0
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities([1007, 2001, 2002], seed=3).values()))
    (tmp_path / "rm.txt").write_text("1003\n1007\n")
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], remove=str(tmp_path / "rm.txt"),
                        model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    now = plan_for(cfg)
    assert kb_delta_note(cfg) == "" and now.order_kb_version == 1  # a fresh run: the KB as it is now
    # golds 2001, 2002 added (trained on now), 1003 removed (left out); 1007 replaced by a new row (still in)
    assert (before.train_mentions, before.excluded_missing_gold) == (3, 2)
    assert (now.train_mentions, now.excluded_missing_gold) == (4, 1)
    then = plan_for(cfg, 0)  # what a run that started at version 0 replays
    assert (then.train_mentions, then.excluded_missing_gold, then.order_kb_version) == (3, 2, 0)
    assert kb_delta_note(cfg, 0) == (
        "KB version 1: this run's data order comes from the golds of KB version 0, where it started (so that it "
        "resumes exactly); training mentions whose gold a later delta added, not trained on in this run: 2; "
        "whose gold a later delta removed, skipped when their batch comes: 1. A new run (another run.name) "
        "trains on the KB as it is now")
    # the first 3 mentions only (data.max_train_mentions): none a delta added
    cfg.data.max_train_mentions = 3
    assert kb_delta_note(cfg, 0).startswith("KB version 1: this run's data order comes from the golds of KB "
                                            "version 0, where it started (so that it resumes exactly); training "
                                            "mentions whose gold a later delta removed, skipped when their batch "
                                            "comes: 1. ")


def test_a_rerun_keeps_the_kb_version_its_checkpoint_started_at(tmp_path, tiny_model_dir):
    """The driver (order_kb_version, from the checkpoint the rerun resumes from) and the workers (saved_plan, off
    the Ray Train checkpoint's manifest alone) take the data order's KB version from the checkpoint, not from
    the store: a delta taken since must not move a resumed run's order (its plan would differ: refused)."""
    from ray.train import Checkpoint

    from dist_nce.core.artifacts import write_manifest
    from dist_nce.train.config import TrainJobConfig
    from dist_nce.train.trainer import order_kb_version
    from dist_nce.worker.checkpoint import KIND, SCHEMA_VERSION, saved_plan
    from dist_nce.worker.launch import SNAPSHOT
    from tests.worker.test_launch import ray_snapshot

    store = prepare_store(tmp_path, "store", entities(range(1000, 1010)), tiny_model_dir, [1001, 2001])
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities([2001], seed=3).values()))
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], model_dir=tiny_model_dir,
                        progress=False), log=lambda s: None)
    cfg = TrainJobConfig()
    cfg.data.prepared_dir, cfg.run.storage_path, cfg.run.name = str(store), str(tmp_path / "ray"), "run"
    assert order_kb_version(cfg) == 1  # a fresh run: the store's current version
    run = tmp_path / "ray" / "run"
    run.mkdir(parents=True)
    (run / SNAPSHOT).write_text(ray_snapshot([("step_00000004", 4)]))
    write_manifest(run / "step_00000004", KIND, SCHEMA_VERSION, step=4, plan={"order_kb_version": 0, "seed": 0})
    assert order_kb_version(cfg) == 0
    assert saved_plan(Checkpoint.from_directory(str(run / "step_00000004")))["order_kb_version"] == 0
    write_manifest(run / "step_00000004", KIND, SCHEMA_VERSION, step=4, plan={"seed": 0})  # before plans kept it
    assert order_kb_version(cfg) == 0 and "order_kb_version" not in saved_plan(
        Checkpoint.from_directory(str(run / "step_00000004")))
