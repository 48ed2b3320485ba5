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

import json
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


class _Delta(_Kept):
    """A KB delta served before step ``delta_at`` (the store already holds it), and the KB version each step
    trained against."""

    delta_at = 1

    def train_step(self, step: int):
        if step == self.delta_at:
            self.service.apply_delta()
        metrics = super().train_step(step)
        self.kb_versions = {**getattr(self, "kb_versions", {}), step: metrics["kb/version"]}
        return metrics

    def finish(self):
        return {**super().finish(), "kb_versions": dict(self.kb_versions)}


def _job(cfg, service, store: Path, resume_from: Path | None = None, worker: type = _Kept
         ) -> tuple[dict, Path | None]:
    """One job of the run: (its result, the last checkpoint it reported, copied under ``store``)."""
    from ray.train import Checkpoint

    last: list[Path] = []

    def report(metrics, checkpoint=None, checkpoint_dir_name=None, **kw):
        if checkpoint is not None:  # the worker's staging directory is removed once report returns
            last.append(Path(shutil.copytree(checkpoint.path, store / checkpoint_dir_name)))

    get = (lambda: Checkpoint.from_directory(str(resume_from))) if resume_from else None
    out = worker(cfg, service, 0, 1, "cpu", report=report, get_checkpoint=get).run()
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


@pytest.mark.slow
@pytest.mark.parametrize("delta_at", [1, 2, 3])
def test_a_run_resumed_around_a_kb_delta_serves_its_checkpoints_kb(tmp_path, process_group, capsys,  # noqa: F811
                                                                    delta_at):
    """Stopped at step 3, after (``delta_at`` 1) or before (3) a mid-run KB delta, or with the delta served and
    no step yet on its negatives (2: the prefetched ones of steps 3 and 4 were mined before it and after it), the
    rerun serves the checkpoint's index version and KB again and takes the uninterrupted run's steps: with 2 it
    follows the delta at step 4, where that run did (it used to follow it from step 3, and step 5's random
    negatives came from the new KB's rows: kb/version and loss differed).

    After: the checkpoint was written before the next refresh, so the delta's index version is above the
    book's. The rerun used to serve the book's version, the KB before the delta: it crashed on a restored
    negative only the new KB holds, or trained on the old KB (outside review). Before: the store is at the
    delta's KB version on disk already; the rerun serves the checkpoint's and says how to serve the store's."""
    from dist_nce.core.models import make_tiny_bert
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever
    from kb.delta import UpdateConfig, update
    from kb.store import EntityStore

    from kb_delta_helpers import entities  # noqa: E402  (tests/ is on sys.path)

    model = make_tiny_bert(tmp_path / "bert")
    base = tiny_config(tmp_path, model, tmp_path / "prep", *SETTINGS)
    ensure_prepared(base.data, model, log=lambda s: None)
    (tmp_path / "add.json").write_text("".join(v + "\n" for v in entities(range(7_000_000, 7_000_012)).values()))
    state = build_retriever(base.model, base.optim.seed).entity_encoder_state()

    def store(name: str) -> str:  # a copy of the prepared store with the delta written (served at delta_at)
        out = tmp_path / name
        shutil.copytree(base.data.prepared_dir, out)
        update(UpdateConfig(store=str(out), add=[str(tmp_path / "add.json")], model_dir=model, progress=False),
               log=lambda s: None)
        assert EntityStore(out).kb_version == 1
        return str(out)

    def config(name: str, stop: int, data: str):
        return tiny_config(tmp_path, model, tmp_path / name, *SETTINGS, f"run.stop_after_steps={stop}",
                           f"data.prepared_dir={data}")

    def service(data: str, shards: str) -> LocalService:
        return LocalService(data, base.model.retriever, base.service, str(tmp_path / shards), state)

    worker = type("DeltaAt", (_Delta,), {"delta_at": delta_at})
    straight_store = store("straight_store")
    straight, _ = _job(config("straight", 6, straight_store), service(straight_store, "straight_shards"),
                       tmp_path / "kept_straight", worker=worker)
    # the run followed the delta (a step trains on the KB its negatives were mined from, prefetched ahead)
    assert (straight["kb_versions"][0], straight["kb_versions"][5]) == (0, 1), straight["kb_versions"]

    data = store("stopped_store")
    first, end = _job(config("stopped", 3, data), service(data, "shards"), tmp_path / "kept", worker=worker)
    assert first["step"] == 3 and first["kb_versions"] == {s: straight["kb_versions"][s] for s in range(3)}
    saved = checkpoint.TrainState.from_json(json.loads((end / "train_state.json").read_text()))
    after = int(delta_at < 3)
    assert (saved.index_version, saved.book.version) == (after, 0)  # after: the delta's, above the last refresh's
    # what the one rank had followed: the delta's KB and index version only once a step used its negatives
    # (here, with 2 steps prefetched, none before step 3 did: KB 0, index version 0 in every case)
    used = straight["kb_versions"][2]
    assert saved.followed == [[used, used]]
    # The rerun's shard serves its newest version on disk (after: the delta's), as a restarted shard does; the
    # rerun used to go back to the book's version 0 (KB 0) from there.
    rerun = service(data, "shards")
    assert rerun.version() == after and rerun.kb_version == after
    capsys.readouterr()
    second, _ = _job(config("stopped", 6, data), rerun, tmp_path / "kept", resume_from=end, worker=worker)
    told = "the store is at KB version 1, this run serves 0 (its checkpoint's)" in capsys.readouterr().out
    assert told == (not after)
    assert second["kb_versions"] == {s: straight["kb_versions"][s] for s in range(3, 6)}
    np.testing.assert_allclose([second["losses"][s] for s in range(3, 6)],
                               [straight["losses"][s] for s in range(3, 6)], rtol=1e-6, atol=1e-7)
