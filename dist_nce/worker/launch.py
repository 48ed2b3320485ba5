"""The driver side shared by both training jobs: one TorchTrainer from a job config's ``run``
section (workers, resources, GPU or not, storage, fault tolerance, checkpoints kept)."""
from __future__ import annotations

import os
from typing import Any, Callable

from dist_nce.cluster.fit import worker_resources  # noqa: F401  (what one worker asks Ray for; re-exported)


def use_gpu(cfg: Any) -> bool:
    """``run.use_gpu``, or auto-detect: GPUs in the Ray cluster."""
    if cfg.run.use_gpu is not None:
        return cfg.run.use_gpu
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def storage_uri(path: str) -> str:
    """Ray Train wants an absolute local path (or a URI such as s3://...)."""
    return path if "://" in path else os.path.abspath(path)


def make_torch_trainer(train_func: Callable[[dict[str, Any]], None], cfg: Any, loop_config: dict[str, Any]):
    """A TorchTrainer running ``train_func`` on ``run.num_workers`` workers; gloo on CPUs, NCCL on GPUs;
    the group meets without a network listener when all workers are on this machine."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dist_nce.worker.process_group import LocalGroupTorchConfig

    run, gpu = cfg.run, use_gpu(cfg)
    return TorchTrainer(
        train_func,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=run.num_workers, use_gpu=gpu,
                                     resources_per_worker=worker_resources(run, gpu)),
        torch_config=LocalGroupTorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=RunConfig(name=run.name, storage_path=storage_uri(run.storage_path),
                             failure_config=FailureConfig(max_failures=run.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=run.num_to_keep)),
    )
