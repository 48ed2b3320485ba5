"""A training run takes a KB delta mid-run (Ray Train, 2 DeepSpeed workers, real shards).

The driver side is jobs/aida_finetune.py's: a KbWatcher beside fit(). Once the run is a few
steps in, the store gets a delta (the golds of 6 of the 16 training mentions removed, new
entities added) and the control file asks the driver to serve it. The delta lands at a
step that depends on timing, so the check is on what must hold whatever that step: the run
finishes, every shard serves the new KB version, the workers follow it, and mentions whose
gold was removed are skipped and counted instead of crashing the run.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from dist_nce.train.kb_control import KbWatcher, request_update
from dist_nce.train.plan import eligible_mentions
from dist_nce.worker.tb import read_metrics
from kb.delta import UpdateConfig, update
from kb.store import EntityStore, MentionTable
from tests.train.tinyrun import losses, prepare_tiny, tiny_config

from kb_delta_helpers import entities  # noqa: E402  (tests/ is on sys.path)

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_a_run_takes_a_kb_delta_without_stopping(ray_local, tiny_model_dir, tmp_path):
    from dist_nce.actors.service import NegativeService
    from dist_nce.train.model import build_retriever
    from dist_nce.train.trainer import fit, unflatten

    prepare_tiny(tmp_path / "kb", tiny_model_dir)
    store = tmp_path / "store"
    shutil.copytree(tmp_path / "kb" / "prepared", store)  # the delta changes it
    cfg = tiny_config(tmp_path / "kb", tiny_model_dir, tmp_path / "run", "run.evaluate_before=false",
                      "run.export=false", "refresh.mode=sync", f"data.prepared_dir={store}")
    train = MentionTable(store, cfg.data.train_split)
    golds = EntityStore(store).source_ids(train.gold_rows[:16][train.gold_rows[:16] >= 0])
    removed = sorted(set(golds))[:6]
    (tmp_path / "rm.txt").write_text("".join(f"{g}\n" for g in removed))
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities(range(7_000_000, 7_000_012)).values()))

    metrics = Path(cfg.run.output_dir) / "metrics.jsonl"

    def change_the_kb_mid_run():
        deadline = time.monotonic() + 600
        while not (metrics.exists() and max(read_metrics(metrics), default=-1) >= 5):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], remove=str(tmp_path / "rm.txt"),
                            model_dir=tiny_model_dir, progress=False), log=lambda s: None)
        request_update(cfg.run.output_dir)

    service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    try:
        service.ensure_encoded(ray.put(build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state()))
        trigger = threading.Thread(target=change_the_kb_mid_run, daemon=True)
        trigger.start()
        with KbWatcher(service, cfg.run.output_dir, interval_s=0.2, log=lambda s: None) as watcher:
            final = unflatten(fit(cfg, service).metrics)
        trigger.join(60)
        status = service.status()
    finally:
        service.shutdown()
    assert final["done"] and final["step"] == 24
    assert len(watcher.outcomes) == 1 and "error" not in watcher.outcomes[0], watcher.outcomes
    assert watcher.outcomes[0]["served_kb_version"] == 1 and {s["kb_version"] for s in status} == {1}
    logged = read_metrics(metrics)
    switched = [s for s in sorted(logged) if logged[s].get("kb/version") == 1]
    assert switched and switched[-1] == 23 and switched == list(range(switched[0], 24)), "followed from then on"
    assert all(logged[s]["kb/version"] == 0 for s in range(switched[0]))
    assert sum(logged[s]["kb/removed_gold_skipped"] for s in switched) > 0, "removed golds were skipped"
    assert sum(logged[s]["kb/removed_gold_skipped"] for s in range(switched[0])) == 0
    assert np.isfinite(list(losses(cfg).values())).all()


def test_a_run_on_a_changed_kb_resumes_exactly(ray_local, tiny_model_dir, tmp_path):
    """A run on a store changed by a delta (golds removed, entities added, all before it starts) trains
    on the current KB version, and stopped then run again it replays the same losses."""
    from tests.train.tinyrun import train

    prepare_tiny(tmp_path / "kb", tiny_model_dir)
    store = tmp_path / "store"
    shutil.copytree(tmp_path / "kb" / "prepared", store)
    train_split = MentionTable(store, "train")
    gold = train_split.gold_rows[:16]
    removed = sorted(set(EntityStore(store).source_ids(gold[gold >= 0])))[:4]
    (tmp_path / "rm.txt").write_text("".join(f"{g}\n" for g in removed))
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities(range(7_000_000, 7_000_012)).values()))
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "add.json")], remove=str(tmp_path / "rm.txt"),
                        model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    common = ["refresh.mode=sync", "refresh.every_steps=0", "run.evaluate_before=false", "run.export=false",
              "optim.max_steps=8", f"data.prepared_dir={store}"]
    reference = tiny_config(tmp_path / "kb", tiny_model_dir, tmp_path / "reference", *common)
    final, status = train(reference)
    assert final["done"] and {s["kb_version"] for s in status} == {1}
    ref = losses(reference)
    logged = read_metrics(Path(reference.run.output_dir) / "metrics.jsonl")
    assert all(logged[s]["kb/version"] == 1 for s in range(8))
    # its data order comes from the golds of KB version 1 (where it starts): the mentions whose gold the delta
    # removed are not in it (they used to be, and were skipped batch by batch)
    assert sum(logged[s]["kb/removed_gold_skipped"] for s in range(8)) == 0
    saved = [json.loads(p.read_text())["plan"] for p in Path(reference.run.storage_path).rglob("manifest.json")
             if "step_" in p.parent.name]
    assert saved and {p["order_kb_version"] for p in saved} == {1}
    now, _ = eligible_mentions(MentionTable(store, "train").gold_rows, reference.data.max_train_mentions)
    then, _ = eligible_mentions(train_split.prepared_gold_rows, reference.data.max_train_mentions)
    assert len(now) < len(then) and {p["train_mentions"] for p in saved} == {len(now)}

    interrupted = tiny_config(tmp_path / "kb", tiny_model_dir, tmp_path / "interrupted", *common,
                              "run.stop_after_steps=5")
    first, _ = train(interrupted)
    assert not first["done"] and first["step"] == 5
    final, status = train(tiny_config(tmp_path / "kb", tiny_model_dir, tmp_path / "interrupted", *common))
    assert final["done"] and final["step"] == 8 and {s["kb_version"] for s in status} == {1}
    resumed = losses(interrupted)
    np.testing.assert_allclose([resumed[s] for s in range(8)], [ref[s] for s in range(8)], rtol=1e-5)
