"""Training through Ray Train (TorchTrainer, 2 DeepSpeed workers on gloo) against real shards.

One module-scoped local Ray (2 CPUs). Every run uses configs/aida/test_tiny.yaml: a random
tiny BERT memorising 16 synthetic mentions over 6 epochs of 4 steps. Asynchronous refresh
is covered end to end by tests/jobs/test_aida_finetune.py (it makes losses timing-dependent).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dist_nce.train.tb import read_metrics
from tests.train.tinyrun import losses, prepare_tiny, tiny_config, train

pytestmark = [pytest.mark.slow, pytest.mark.ray]
# Deterministic runs: sync refresh at epoch starts (every batch after it uses the new index).
DETERMINISTIC = ["refresh.mode=sync", "refresh.every_steps=0", "run.evaluate_before=false", "run.export=false"]


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("tiny_kb")
    prepare_tiny(root, tiny_model_dir)
    return root


class ShardKiller(threading.Thread):
    """SIGKILLs one shard process once the run has logged ``after`` steps."""

    def __init__(self, service, metrics: Path, after: int = 6, shard: int = 1):
        super().__init__(daemon=True)
        self.victim, self.metrics, self.after = service.status()[shard], metrics, after
        self.killed = threading.Event()

    def run(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not self.killed.is_set():
            if self.metrics.exists() and len(read_metrics(self.metrics)) >= self.after:
                os.kill(self.victim["pid"], signal.SIGKILL)
                self.killed.set()
            time.sleep(0.1)


class WorkerKiller(threading.Thread):
    """SIGKILLs one Ray Train worker process (found by its process title, as an operator
    would with ps) once the run has logged ``after`` steps."""

    def __init__(self, metrics: Path, after: int):
        super().__init__(daemon=True)
        self.metrics, self.after, self.victim = metrics, after, None
        self.killed = threading.Event()

    @staticmethod
    def workers() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                    pids.append(int(entry.name))
            except OSError:  # exited meanwhile
                continue
        return sorted(pids)

    def run(self):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not self.killed.is_set():
            if self.metrics.exists() and len(read_metrics(self.metrics)) >= self.after:
                pids = self.workers()
                if pids:
                    self.victim = pids[-1]
                    os.kill(self.victim, signal.SIGKILL)
                self.killed.set()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def straight(ray_local, kb, tiny_model_dir, tmp_path_factory):
    """24 steps during which one shard process is killed (after 6 steps) and then one Ray
    Train worker (after 14: the group restarts from the step-12 checkpoint). The resume test
    shows every loss equals a run interrupted differently, so neither kill changed anything."""
    cfg = tiny_config(kb, tiny_model_dir, tmp_path_factory.mktemp("straight"), *DETERMINISTIC,
                      "run.checkpoint_every_steps=3", "run.max_failures=2",
                      # the bias monitor too: the resume test then also shows it changes no loss
                      "bias.every_steps=8", "bias.probe_mentions=4", "bias.draws=4")
    metrics = Path(cfg.run.output_dir) / "metrics.jsonl"
    killers = {}

    def with_killers(service):
        killers["shard"] = ShardKiller(service, metrics)
        killers["worker"] = WorkerKiller(metrics, after=14)
        for k in killers.values():
            k.start()

    final, status = train(cfg, during=with_killers)
    for k in killers.values():
        k.killed.set()  # stop polling if the run ended first
    return cfg, final, losses(cfg), killers, status


def test_two_worker_deepspeed_run_learns(straight):
    cfg, final, loss, _, _ = straight
    assert final["done"] and final["step"] == 24 and final["plan"]["num_workers"] == 2
    assert sorted(loss) == list(range(24))
    first, last = np.mean([loss[s] for s in range(4)]), np.mean([loss[s] for s in range(20, 24)])
    # log 8 = 2.08 at the start; each epoch-start refresh makes the hard half harder
    assert first > 1.9 and last < first - 0.3, (first, last)
    assert final["index_version"] == 6  # refreshed at the start of epochs 1..5, and with the final weights


def test_a_killed_shard_and_a_killed_worker_lose_no_batch(straight):
    cfg, final, _, killers, status = straight
    assert killers["shard"].victim["pid"] not in [s["pid"] for s in status], "the shard was not killed"
    assert killers["worker"].victim is not None, "no Ray Train worker was killed during training"
    lines = [json.loads(line) for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [d["step"] for d in lines if "train/loss" in d]
    # In order, except one jump back: after the worker died the group restarted from the
    # last checkpoint (a multiple of 3) and trained the steps after it again.
    back = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
    assert len(back) == 1, f"no restart from a checkpoint after the worker was killed: steps {steps}"
    assert sorted(set(steps)) == list(range(24)) and steps[-1] == 23, steps
    restart = steps[back[0]]
    assert restart % 3 == 0 and restart <= steps[back[0] - 1], steps
    # (and the resume test shows every loss equals a run interrupted another way)


def test_resume_reproduces_the_uninterrupted_run(straight, kb, tiny_model_dir, tmp_path):
    reference = straight[2]
    first = tiny_config(kb, tiny_model_dir, tmp_path, *DETERMINISTIC, "run.stop_after_steps=10")
    final, _ = train(first)
    assert not final["done"] and final["step"] == 10
    assert sorted(losses(first)) == list(range(10))
    # Same run name and storage: Ray Train hands the step-10 checkpoint (mid-epoch 2) to the
    # workers; the new shards reload the persisted index version 2 from the run directory.
    final, _ = train(tiny_config(kb, tiny_model_dir, tmp_path, *DETERMINISTIC))
    assert final["done"] and final["step"] == 24
    resumed = losses(first)
    assert sorted(resumed) == list(range(24))
    np.testing.assert_allclose([resumed[s] for s in range(24)], [reference[s] for s in range(24)], rtol=1e-5)


def test_the_bias_monitor_logs_theorem_1s_bias_with_its_standard_error(straight):
    cfg = straight[0]
    steps = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
    measured = sorted(s for s, v in steps.items() if "bias/norm" in v)
    assert measured == [7, 15, 23], measured  # after 8, 16 and 24 optimizer steps
    for s in measured:
        v = steps[s]
        assert np.isfinite(v["bias/norm"]) and v["bias/norm"] > 0 and v["bias/norm_se"] > 0, v
        assert v["bias/version"] >= 0 and v["bias/seconds"] > 0


# ZeRO-3 (parameters partitioned: refresh, evaluation and export gather them) and bf16 (AMX
# matmuls on this CPU) through the same loop: 8 steps = 2 epochs, so one refresh at the
# start of epoch 1 plus the final one; the interrupted run stops at step 5, after that refresh.
ENGINES = {"zero3_fp32": (3, False), "zero2_bf16": (2, True)}


@pytest.mark.parametrize("ds", sorted(ENGINES))
def test_zero3_and_bf16_refresh_and_resume_exactly(ds, straight, kb, tiny_model_dir, tmp_path):
    stage, bf16 = ENGINES[ds]
    common = [*DETERMINISTIC, f"deepspeed.config=configs/deepspeed/{ds}.json", "optim.max_steps=8"]
    reference = tiny_config(kb, tiny_model_dir, tmp_path / "reference", *common, "run.export=true")
    final, _ = train(reference)
    assert final["done"] and final["step"] == 8 and final["index_version"] == 2  # v1 at epoch 1, v2 final
    assert final["engine"] == {"device": "cpu", "accelerator": "cpu", "zero_stage": stage, "bf16": bf16,
                               "world_size": 2}, final["engine"]
    assert Path(final["export"]["model"]).is_dir()  # ZeRO-3: the full weights gathered for the export
    ref = losses(reference)
    assert sorted(ref) == list(range(8)) and np.isfinite(list(ref.values())).all(), ref
    # The first step's loss (same initial weights, same negatives) within bf16's precision of fp32's.
    np.testing.assert_allclose(ref[0], straight[2][0], rtol=0, atol=0.05 if bf16 else 1e-4)

    interrupted = tiny_config(kb, tiny_model_dir, tmp_path / "interrupted", *common, "run.stop_after_steps=5")
    first, _ = train(interrupted)
    assert not first["done"] and first["step"] == 5
    final, _ = train(tiny_config(kb, tiny_model_dir, tmp_path / "interrupted", *common))
    assert final["done"] and final["step"] == 8
    resumed = losses(interrupted)
    np.testing.assert_allclose([resumed[s] for s in range(8)], [ref[s] for s in range(8)], rtol=1e-5)
