"""A retriever run stopped and resumed takes the uninterrupted run's steps exactly, with dropout on and
negatives prefetched: the training worker in this process (no Ray: one in-process shard, tests/train/
local_service.py; the checkpoints Ray Train would store kept by the test).

Two things broke this, both invisible with the dropout-free tiny BERT the other tests train:

* Hugging Face's ``from_pretrained`` hands the towers over in eval mode and only the prefetcher's mention
  encodes put them in train mode, so a job resumed with restored prefetched negatives (it encodes nothing
  before its first step) trained its first steps without dropout (worker.scaffold sets train mode);
* a job ending at ``run.stop_after_steps`` prefetched nothing past its last step, so the next job mined its
  first steps' negatives with later weights than the uninterrupted run had (it now prefetches up to the
  run's last step and its end checkpoint keeps them).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.train import checkpoint
from dist_nce.train.loop import Worker
from tests.train.local_service import LocalService
from tests.train.test_entity_cache import process_group  # noqa: F401 (a fixture)
from tests.train.tinyrun import tiny_config

# One worker on ZeRO-0 fp32; the entity tower trains against version 0 of the index (no refresh: that needs
# Ray's object store). 16 mentions in batches of 4: 4 steps an epoch, a checkpoint at each epoch's end.
SETTINGS = ("refresh.mode=never", "run.num_workers=1", "run.export=false", "run.evaluate_before=false",
            "deepspeed.config=configs/deepspeed/zero0_fp32.json", "negatives.prefetch=2",
            "run.checkpoint_every_steps=0")


class _Kept(Worker):
    """Records each step's loss and whether every module trained in train mode."""

    def train_step(self, step: int):
        self.modes = [*getattr(self, "modes", []), all(m.training for m in self.module.modules())]
        metrics = super().train_step(step)
        self.losses = {**getattr(self, "losses", {}), step: metrics["train/loss"]}
        return metrics

    def finish(self):
        out = super().finish()
        out["losses"], out["modes"] = dict(self.losses), list(self.modes)
        return out


def _job(cfg, service, store: Path, resume_from: Path | None = None) -> tuple[dict, Path | None]:
    """One job of the run: (its result, the last checkpoint it reported, copied under ``store``)."""
    from ray.train import Checkpoint

    last: list[Path] = []

    def report(metrics, checkpoint=None, checkpoint_dir_name=None, **kw):
        if checkpoint is not None:  # the worker's staging directory is removed once report returns
            last.append(Path(shutil.copytree(checkpoint.path, store / checkpoint_dir_name)))

    get = (lambda: Checkpoint.from_directory(str(resume_from))) if resume_from else None
    out = _Kept(cfg, service, 0, 1, "cpu", report=report, get_checkpoint=get).run()
    return out, (last[-1] if last else None)


@pytest.mark.slow
def test_a_stopped_and_resumed_run_takes_the_uninterrupted_runs_steps(tmp_path, process_group):  # noqa: F811
    from dist_nce.core.models import make_tiny_bert
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever

    model = make_tiny_bert(tmp_path / "bert", dropout=0.1)
    base = tiny_config(tmp_path, model, tmp_path / "prep", *SETTINGS)
    ensure_prepared(base.data, model, log=lambda s: None)
    service = LocalService(base.data.prepared_dir, base.model.retriever, base.service, str(tmp_path / "shards"),
                           build_retriever(base.model, base.optim.seed).entity_encoder_state())

    def config(name: str, stop: int):
        return tiny_config(tmp_path, model, tmp_path / name, *SETTINGS, f"run.stop_after_steps={stop}")

    straight, _ = _job(config("straight", 7), service, tmp_path / "kept_straight")
    assert sorted(straight["losses"]) == list(range(7)) and all(straight["modes"])

    first, end = _job(config("stopped", 3), service, tmp_path / "kept")
    assert not first["done"] and first["step"] == 3 and end is not None
    pending = checkpoint.load_pending(end, 0)  # the next job's first two steps, mined as the straight run mines
    assert pending is not None and list(pending.steps) == [3, 4]
    second, _ = _job(config("stopped", 7), service, tmp_path / "kept", resume_from=end)
    assert sorted(second["losses"]) == [3, 4, 5, 6] and all(second["modes"])
    np.testing.assert_allclose([first["losses"][s] for s in range(3)], [straight["losses"][s] for s in range(3)],
                               rtol=0, atol=0)
    np.testing.assert_allclose([second["losses"][s] for s in range(3, 7)],
                               [straight["losses"][s] for s in range(3, 7)], rtol=1e-6, atol=1e-7)
    # the towers have dropout to switch on (with none, train and eval mode would score alike and this test
    # could not tell them apart)
    drop = [m.p for m in build_retriever(base.model, base.optim.seed).modules() if isinstance(m, torch.nn.Dropout)]
    assert drop and min(drop) == 0.1
