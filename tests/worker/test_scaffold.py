"""The worker scaffold shared by the retriever and the reranker: each worker takes its DeepSpeed
accelerator from its OWN device, whatever the driver's environment says; both trainers ask Ray
for the same resources the cluster check counts."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_nce.core.config import load_config, to_dict
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.train.config import TrainJobConfig
from dist_nce.worker.launch import worker_resources
from dist_nce.worker.scaffold import accelerator_for
from tests.train.tinyrun import REPO

RERANK_CONFIG = REPO / "configs" / "zeshel" / "reranker_tiny_cpu.yaml"
TRAIN_CONFIG = REPO / "configs" / "aida" / "test_tiny.yaml"


def test_accelerator_follows_the_device():
    assert accelerator_for("cpu") == "cpu"
    assert accelerator_for(torch.device("cuda", 1)) == "cuda"
    assert accelerator_for("cuda:0") == "cuda"


class FakeRayTrain:
    """ray.train's per-worker calls, as Ray Train answers them on a worker with ``device``."""

    def __init__(self, monkeypatch, device: str):
        import ray.train
        import ray.train.torch

        import dist_nce.cluster.runtime

        monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device(device))
        monkeypatch.setattr(ray.train, "get_context",
                            lambda: SimpleNamespace(get_world_rank=lambda: 1, get_world_size=lambda: 2))
        monkeypatch.setattr(dist_nce.cluster.runtime, "configure_process", lambda threads=1: None)


def capture_run(monkeypatch, worker_cls) -> dict:
    """Replace ``worker_cls.run`` by a probe of what the worker was built with."""
    seen: dict = {}

    def run(self):
        seen.update(accelerator=os.environ["DS_ACCELERATOR"], rank=self.rank, world=self.world,
                    device=str(self.device), cfg=self.cfg)
        return seen

    monkeypatch.setattr(worker_cls, "run", run)
    return seen


# The driver's DS_ACCELERATOR reaches every worker through the runtime env: a CPU head driving
# GPU workers, or a GPU head driving CPU workers. Before the scaffold the reranker kept it.
@pytest.mark.parametrize("driver, device, want", [("cpu", "cuda:0", "cuda"), ("cuda", "cpu", "cpu")])
def test_reranker_worker_picks_its_accelerator_from_its_device(monkeypatch, driver, device, want):
    from dist_nce.rerank.loop import RerankWorker, train_func

    monkeypatch.setenv("DS_ACCELERATOR", driver)
    FakeRayTrain(monkeypatch, device)
    seen = capture_run(monkeypatch, RerankWorker)
    cfg = load_config(RerankJobConfig, RERANK_CONFIG)
    train_func({"job": to_dict(cfg)})
    assert seen["accelerator"] == want and seen["device"] == str(torch.device(device))
    assert (seen["rank"], seen["world"]) == (1, 2) and seen["cfg"] == cfg


@pytest.mark.parametrize("driver, device, want", [("cpu", "cuda:0", "cuda"), ("cuda", "cpu", "cpu")])
def test_retriever_worker_picks_its_accelerator_from_its_device(monkeypatch, driver, device, want):
    from dist_nce.train.loop import Worker, train_func

    monkeypatch.setenv("DS_ACCELERATOR", driver)
    FakeRayTrain(monkeypatch, device)
    seen = capture_run(monkeypatch, Worker)
    service = object()
    cfg = load_config(TrainJobConfig, TRAIN_CONFIG)
    train_func({"job": to_dict(cfg), "service": service})
    assert seen["accelerator"] == want and seen["device"] == str(torch.device(device))


@pytest.mark.parametrize("cls, path", [(TrainJobConfig, TRAIN_CONFIG), (RerankJobConfig, RERANK_CONFIG)])
def test_both_trainers_request_custom_resources_per_worker(cls, path):
    from dist_nce.cluster.fit import workers_request

    cfg = load_config(cls, path, ["run.resources_per_worker={trainer: 1}", "run.cpus_per_worker=0.5",
                                  "run.gpus_per_worker=0.25"])
    assert worker_resources(cfg.run, gpu=False) == {"CPU": 0.5, "trainer": 1}
    assert worker_resources(cfg.run, gpu=True) == {"CPU": 0.5, "GPU": 0.25, "trainer": 1}
    # the pre-flight check counts exactly what the TorchTrainer will ask for
    assert workers_request(cfg.run, gpu=True).each == worker_resources(cfg.run, gpu=True)


@pytest.mark.parametrize("worker_cls", ["dist_nce.train.loop:Worker", "dist_nce.rerank.loop:RerankWorker"])
def test_a_checkpoint_is_staged_in_scratch_and_a_killed_workers_staging_is_removed(monkeypatch, tmp_path,
                                                                                    worker_cls):
    """Both trainers stage a checkpoint in a scratch directory of their own prefix (gone once Ray Train
    has it), and the first save on a machine removes what a killed worker left there mid-save."""
    import importlib
    import subprocess
    import sys
    import tempfile

    from dist_nce.core.scratch import scratch_name
    from dist_nce.worker import checkpoint

    module, name = worker_cls.split(":")
    cls = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own temp directory
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{scratch_name(cls.ckpt_prefix, dead.pid)}k1ll"
    (left / "deepspeed").mkdir(parents=True)
    (left / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)

    def fake_save(engine, directory, state, rank, plan, tensors=None):
        (Path(directory) / "manifest.json").write_text("{}")

    reported = []

    def report(metrics, checkpoint=None, checkpoint_dir_name=None):
        staged = Path(checkpoint.path)
        reported.append((staged, sorted(p.name for p in staged.iterdir()), checkpoint_dir_name))

    monkeypatch.setattr(checkpoint, "save", fake_save)
    worker = cls.__new__(cls)
    worker.engine, worker.rank, worker.report = None, 0, report
    worker.state, worker.plan = SimpleNamespace(step=7), SimpleNamespace(as_dict=dict)
    worker.checkpoint_tensors = dict
    worker.save_checkpoint({"step": 7, "loss": 1.0})

    (staged, files, dir_name), = reported
    assert files == ["manifest.json"] and dir_name == "step_00000007"
    assert staged.parent == tmp_path and staged.name.startswith(scratch_name(cls.ckpt_prefix))
    assert not staged.exists()  # removed once reported
    assert not left.exists()
