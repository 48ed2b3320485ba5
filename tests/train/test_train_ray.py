"""Training through Ray Train (TorchTrainer, 2 DeepSpeed workers on gloo) against real shards.

One module-scoped local Ray (2 CPUs). Every run uses configs/aida/test_tiny.yaml: a random
tiny BERT memorising 16 synthetic mentions over 6 epochs of 4 steps. Asynchronous refresh
is covered end to end by tests/jobs/test_aida_finetune.py (it makes losses timing-dependent);
killed shards, workers and drivers by tests/jobs/test_chaos.py, lost nodes by
tests/cluster/test_multinode.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dist_nce.worker import checkpoint
from dist_nce.worker.launch import SNAPSHOT
from dist_nce.worker.tb import read_metrics
from tests.train.tinyrun import losses, prepare_tiny, tiny_config, train

pytestmark = [pytest.mark.slow, pytest.mark.ray]
# Deterministic runs: sync refresh at epoch starts (every batch after it uses the new index).
DETERMINISTIC = ["refresh.mode=sync", "refresh.every_steps=0", "run.evaluate_before=false", "run.export=false"]


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("tiny_kb")
    prepare_tiny(root, tiny_model_dir)
    return root


@pytest.fixture(scope="module")
def straight(ray_local, kb, tiny_model_dir, tmp_path_factory):
    """24 steps with the bias monitor on; its losses are the fp32 reference of the bf16 run."""
    cfg = tiny_config(kb, tiny_model_dir, tmp_path_factory.mktemp("straight"), *DETERMINISTIC,
                      "run.checkpoint_every_steps=3", "bias.every_steps=8", "bias.probe_mentions=4", "bias.draws=4")
    final, status = train(cfg)
    return cfg, final, losses(cfg), status


def test_two_worker_deepspeed_run_learns(straight):
    cfg, final, loss, _ = straight
    assert final["done"] and final["step"] == 24 and final["plan"]["num_workers"] == 2
    assert sorted(loss) == list(range(24))
    first, last = np.mean([loss[s] for s in range(4)]), np.mean([loss[s] for s in range(20, 24)])
    # log 8 = 2.08 at the start; each epoch-start refresh makes the hard half harder
    assert first > 1.9 and last < first - 0.3, (first, last)
    assert final["index_version"] == 6  # refreshed at the start of epochs 1..5, and with the final weights


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
# One shard: what these runs prove is the engine's (partitioned gathers, bf16, its checkpoint), and each
# shard process costs ~5 CPU-s per run (6 runs here). Two shards' merged negatives replay exactly in
# tests/jobs/test_chaos.py and tests/cluster/test_multinode.py; and the first-step check below compares
# against the two-shard straight run, so in fp32 (to 1e-4) it also shows one shard serving the same
# negatives as two.
ENGINES = {"zero3_fp32": (3, False), "zero2_bf16": (2, True)}


@pytest.mark.parametrize("ds", sorted(ENGINES))
def test_zero3_and_bf16_refresh_and_resume_exactly(ds, straight, kb, tiny_model_dir, tmp_path):
    stage, bf16 = ENGINES[ds]
    common = [*DETERMINISTIC, f"deepspeed.config=configs/deepspeed/{ds}.json", "optim.max_steps=8",
              "service.num_shards=1"]
    reference = tiny_config(kb, tiny_model_dir, tmp_path / "reference", *common, "run.export=true")
    final, _ = train(reference)
    assert final["done"] and final["step"] == 8 and final["index_version"] == 2  # v1 at epoch 1, v2 final
    assert final["engine"] == {"device": "cpu", "accelerator": "cpu", "zero_stage": stage, "bf16": bf16,
                               "world_size": 2}, final["engine"]
    assert Path(final["export"]["model"]).is_dir()  # ZeRO-3: the full weights gathered for the export
    ref = losses(reference)
    assert sorted(ref) == list(range(8)) and np.isfinite(list(ref.values())).all(), ref
    # The first step's loss (same initial weights, same negatives from one shard as from the straight run's
    # two) within bf16's precision of fp32's.
    np.testing.assert_allclose(ref[0], straight[2][0], rtol=0, atol=0.05 if bf16 else 1e-4)

    # Stopped after step 5, run again: the same losses. With the bias monitor on (every rank
    # encodes the probe, gathered under ZeRO-3), which the reference does not run: it changes no loss.
    monitor = ["bias.every_steps=4", "bias.probe_mentions=4", "bias.draws=4"]
    interrupted = tiny_config(kb, tiny_model_dir, tmp_path / "interrupted", *common, *monitor,
                              "run.stop_after_steps=5")
    first, _ = train(interrupted)
    assert not first["done"] and first["step"] == 5
    run_dir = Path(interrupted.run.storage_path) / interrupted.run.name
    written = sorted(d.name for d in run_dir.iterdir() if d.is_dir())
    # both ranks' parts of each checkpoint (ZeRO partitions, RNG) are there: whole, as incomplete() reads them
    assert written and [checkpoint.incomplete(run_dir / d) for d in written] == [None] * len(written), written
    if ds == "zero2_bf16":
        # As a stop between the workers' copy and Ray Train's first record leaves it: the checkpoints and no
        # snapshot. The rerun resumes from the newest whole one (worker.launch.recover_unrecorded), not step 0.
        (run_dir / SNAPSHOT).unlink()
    final, _ = train(tiny_config(kb, tiny_model_dir, tmp_path / "interrupted", *common, *monitor))
    assert final["done"] and final["step"] == 8
    resumed = losses(interrupted)
    logged = [json.loads(line)["step"] for line in (Path(interrupted.run.output_dir) / "metrics.jsonl").open()
              if "train/loss" in line]
    assert logged == list(range(8)), logged  # the rerun trained steps 5-7 only: it resumed, not started over
    np.testing.assert_allclose([resumed[s] for s in range(8)], [ref[s] for s in range(8)], rtol=1e-5)
    bias = read_metrics(Path(interrupted.run.output_dir) / "metrics.jsonl")
    assert [s for s in sorted(bias) if "bias/norm" in bias[s]] == [3, 7] and np.isfinite(bias[7]["bias/norm"])
