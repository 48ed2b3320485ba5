"""A reranker run stopped at ``run.stop_after_steps`` and resumed takes the uninterrupted run's steps exactly,
with dropout on in the encoder and the score head: the DeepSpeed worker in this process (no Ray Train: the
checkpoints it would store are kept by the test). What a resume must restore for this: the weights, Adam's
moments, the LR schedule's position, every RNG (dropout's masks) and the step; the data order is a function of
(seed, epoch, step). The data is tests/rerank/test_rerank_data.py's (synthetic Zeshel)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.rerank.loop import RerankWorker
from tests.rerank.test_rerank_data import setup  # noqa: F401  (a fixture)
from tests.rerank.test_rerank_local import _recording, process_group, small_config  # noqa: F401  (fixtures)


def _job(cfg, store: Path, resume_from: Path | None = None) -> tuple[dict, Path | None]:
    """One job of the run: (its result, the last checkpoint it reported, copied under ``store``)."""
    from ray.train import Checkpoint

    last: list[Path] = []

    def report(metrics, checkpoint=None, checkpoint_dir_name=None, **kw):
        if checkpoint is not None:  # the worker's staging directory is removed once report returns
            last.append(Path(shutil.copytree(checkpoint.path, store / checkpoint_dir_name)))

    class Kept(_recording(RerankWorker)):
        save_checkpoint = RerankWorker.save_checkpoint  # _recording's workers write none

        def train_step(self, step: int):
            self.steps = [*getattr(self, "steps", []), step]
            return super().train_step(step)

        def finish(self):
            out = super().finish()
            out["steps"] = list(self.steps)
            return out

    get = (lambda: Checkpoint.from_directory(str(resume_from))) if resume_from else None
    out = Kept(cfg, 0, 1, "cpu", report=report, get_checkpoint=get).run()
    return out, (last[-1] if last else None)


@pytest.mark.slow
def test_a_stopped_and_resumed_reranker_takes_the_uninterrupted_runs_steps(setup, tmp_path, process_group):  # noqa: F811
    from dist_nce.core.models import make_tiny_bert

    model = make_tiny_bert(tmp_path / "bert", dropout=0.1)

    def config(name: str, stop: int):
        cfg = small_config(setup, model, tmp_path / name)
        cfg.model.reranker.dropout, cfg.optim.epochs, cfg.run.stop_after_steps = 0.1, 2, stop
        return cfg

    straight, _ = _job(config("straight", 0), tmp_path / "kept_straight")
    total = straight["plan"]["total_steps"]
    assert straight["done"] and straight["steps"] == list(range(total)) and all(straight["modes"]) and total >= 6
    stop = total // 2 + 1  # inside an epoch: no epoch-end checkpoint to resume from by chance
    first, end = _job(config("stopped", stop), tmp_path / "kept")
    assert not first["done"] and first["steps"] == list(range(stop)) and end is not None
    second, _ = _job(config("stopped", 0), tmp_path / "kept", resume_from=end)
    assert second["done"] and second["steps"] == list(range(stop, total)) and all(second["modes"])
    np.testing.assert_allclose(first["losses"], straight["losses"][:stop], rtol=0, atol=0)
    np.testing.assert_allclose(second["losses"], straight["losses"][stop:], rtol=1e-6, atol=1e-7)
    for k, v in straight["weights"].items():
        torch.testing.assert_close(second["weights"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    # dropout is on in both (with none, a lost RNG state could not change a loss and this test could not see it)
    bert = json.loads((Path(model) / "config.json").read_text())
    assert bert["hidden_dropout_prob"] == bert["attention_probs_dropout_prob"] == 0.1
