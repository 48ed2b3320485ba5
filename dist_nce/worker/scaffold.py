"""The story every training worker tells, written once for the retriever and the reranker.

    entry     Ray Train calls ``train_func`` -> :func:`worker_main`: typed config, threads, this
              worker's device and the DeepSpeed accelerator that matches it
    setup     (the subclass) data, plan, model -> :meth:`WorkerScaffold.make_engine`
    resume    engine + RNG + step from ``ray.train.get_checkpoint()`` (+ the subclass's extras);
              rank 0 opens ``run.tracking``'s MLflow / W&B run (``dist_nce.worker.tracking``)
    loop      (the subclass) ``train_step`` -> :meth:`WorkerScaffold.after_step`: rank-mean
              scalars to TensorBoard / metrics.jsonl (and the trackers), progress bar,
              checkpoints when due
    finish    (the subclass) evaluation, export -> :meth:`WorkerScaffold.end_checkpoint`

A fix to any of these lands in both trainers (they had drifted: only the retriever matched
DeepSpeed's accelerator to its device). Subclasses fill in ``setup``, ``train_step`` and
``finish``, and may override the ``restore`` / ``checkpoint_tensors`` / ``during_training``
hooks (``state_cls`` names the loop state a checkpoint keeps; ``checkpoint_tensors`` adds
named tensors to it). The Ray calls are constructor arguments, so one process can run a worker too.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable

import torch

from dist_nce.core.config import from_dict, to_dict
from dist_nce.core.scratch import scratch_dir
from dist_nce.worker import checkpoint
from dist_nce.worker.collectives import Collectives
from dist_nce.worker.engine import build_engine, load_deepspeed_config
from dist_nce.worker.tb import RunLogger
from dist_nce.worker.tracking import start_tracking


def accelerator_for(device: torch.device | str) -> str:
    """The DeepSpeed accelerator (``DS_ACCELERATOR``) for a worker on ``device``."""
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def worker_main(config_cls: type, config: dict[str, Any], make_worker: Callable[..., "WorkerScaffold"]) -> Any:
    """Ray Train's ``train_loop_per_worker`` body: ``config["job"]`` -> ``config_cls`` ->
    ``make_worker(cfg, rank, world, device, report=, get_checkpoint=)`` -> ``run()``."""
    import ray.train
    import ray.train.torch

    from dist_nce.cluster.runtime import configure_process
    from dist_nce.worker.launch import resume_checkpoint

    cfg = from_dict(config_cls, config["job"], source="train_loop_config.job")
    configure_process(threads=max(1, int(cfg.run.cpus_per_worker)))
    device = ray.train.torch.get_device()
    # The runtime env carries the DRIVER's DS_ACCELERATOR (cpu on a GPU-less head, cuda on a GPU
    # head driving CPU workers); DeepSpeed reads it once, when first asked for its accelerator,
    # which happens after this (make_engine).
    os.environ["DS_ACCELERATOR"] = accelerator_for(device)
    ctx = ray.train.get_context()
    return make_worker(cfg, ctx.get_world_rank(), ctx.get_world_size(), device,
                       report=ray.train.report, get_checkpoint=resume_checkpoint(config)).run()


class WorkerScaffold:
    """Base of the retriever's and the reranker's worker; see the module docstring."""

    label = "worker"  # first word of the start line in the log
    ckpt_prefix = "dist_nce_ckpt_"
    mean_keys: tuple[str, ...] = ("train/loss",)  # scalars averaged over ranks before logging
    state_cls: type[checkpoint.WorkerState] = checkpoint.WorkerState  # the loop state checkpoints keep

    def __init__(self, cfg: Any, rank: int, world: int, device: torch.device | str,
                 report: Callable[..., None] | None = None, get_checkpoint: Callable[[], Any] | None = None):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device(device)
        self.report = report or (lambda metrics, checkpoint=None, **kw: None)
        self.get_checkpoint = get_checkpoint or (lambda: None)
        self.comm = Collectives(world, self.device)

    # ------------------------------------------------------------------ the story

    def run(self) -> dict[str, Any]:
        self.setup()
        self.resume()
        self.before_training()
        # Hugging Face's from_pretrained hands its models over in eval mode (every dropout off) and DeepSpeed
        # keeps the mode it is given. Before this, the reranker's encoder trained without its dropout, and the
        # retriever got train mode only from its negatives' mention encodes (which restore it): a run resumed
        # with restored prefetched negatives encoded nothing first and trained those steps without dropout,
        # other losses than the uninterrupted run's.
        self.module.train()
        for step in range(self.state.step, self.end):
            self.after_step(step, self.train_step(step))
        return self.finish()

    def setup(self) -> None:
        """Data, ``self.plan`` (with ``as_dict``, ``num_workers``, ``total_steps``,
        ``steps_per_epoch``), ``self.end`` and the engine (:meth:`make_engine`)."""
        raise NotImplementedError

    def before_training(self) -> None:
        """After resume, before the first step of this job."""

    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def during_training(self, step: int, done: int, metrics: dict[str, float]) -> None:
        """After logging step ``step`` (``done`` = step + 1 optimizer steps taken), before its checkpoint."""

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {"loss": f"{metrics['train/loss']:.3f}"}

    def finish(self) -> dict[str, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ engine

    def check_world(self) -> None:
        if self.plan.num_workers != self.world:
            raise RuntimeError(f"run.num_workers={self.plan.num_workers} but Ray Train started {self.world} workers")

    def make_engine(self, model: torch.nn.Module) -> None:
        """``model`` on this worker's device inside a DeepSpeed engine (ZeRO stage and bf16 from
        the config's JSON and overrides); checkpoints load with ``weights_only=True``."""
        cfg = self.cfg
        ds = load_deepspeed_config(cfg.deepspeed.config, self.plan.per_worker_batch, self.world, cfg.optim.grad_clip,
                                   cfg.deepspeed.zero_stage, cfg.deepspeed.bf16)
        self.engine, self.optimizer, self.scheduler = build_engine(
            model.to(self.device), ds, cfg.optim.lr, cfg.optim.weight_decay, self.plan.total_steps,
            cfg.optim.warmup_proportion, dist_init_required=False)
        checkpoint.install_weights_only_loading(self.engine)
        self.module = self.engine.module
        self.zero3 = self.engine.zero_optimization_stage() == 3
        from deepspeed.accelerator import get_accelerator

        self.accelerator = get_accelerator().device_name()

    def engine_info(self) -> dict[str, Any]:
        """How this worker trained (reported with the run's result: summary.json, result.json)."""
        return {"device": str(self.device), "accelerator": self.accelerator,
                "zero_stage": int(self.engine.zero_optimization_stage()),
                "bf16": bool(self.engine.bfloat16_enabled()), "world_size": self.world}

    # ------------------------------------------------------------------ resume

    def restore(self, directory: str) -> checkpoint.WorkerState:
        """Engine, RNG and loop state from a checkpoint directory (subclasses add their extras)."""
        return checkpoint.load(self.engine, directory, self.rank, self.plan.as_dict(), self.state_cls)

    def resume(self) -> None:
        self.state, resumed = self.state_cls(), self.get_checkpoint()
        if resumed is not None:
            with resumed.as_directory() as d:
                self.state = self.restore(d)
        run = self.cfg.run
        # run.tracking: MLflow / W&B on rank 0 (None when off: nothing imported)
        tracker = start_tracking(run.tracking, to_dict(self.cfg), run.output_dir, run.name) if self.rank == 0 else None
        self.log = RunLogger(run.output_dir, self.rank, self.plan.total_steps, self.state.step, run.progress, tracker)
        for line in tracker.lines if tracker else []:
            self.log.write(f"tracking: {line}")
        e = self.engine_info()
        self.log.write(f"{self.label} {self.rank}/{self.world}: " + (
            f"resumed at step {self.state.step}" if resumed else "fresh start")
            + f"; this job trains steps [{self.state.step}, {self.end}) of {self.plan.total_steps} on "
            f"{e['device']} ("
            + (f"DeepSpeed accelerator {e['accelerator']}, ZeRO-{e['zero_stage']}" if e["accelerator"] else
               "plain torch, no DeepSpeed")
            + f"{', bf16' if e['bf16'] else ''})")

    # ------------------------------------------------------------------ steps, checkpoints

    def after_step(self, step: int, metrics: dict[str, float]) -> None:
        run, done = self.cfg.run, step + 1
        if done % run.log_every_steps == 0 or done == self.end:
            for k, v in zip(self.mean_keys, self.comm.mean([metrics[k] for k in self.mean_keys])):
                metrics[k] = v
            self.log.log(step, metrics)
        self.log.progress(self.progress_postfix(metrics))
        self.during_training(step, done, metrics)
        if self.checkpoint_due(done) and done < self.end:  # the last one is saved by finish()
            self.save_checkpoint({"step": done, "loss": metrics["train/loss"]})

    def checkpoint_due(self, done: int) -> bool:
        every = self.cfg.run.checkpoint_every_steps
        return bool(every and done % every == 0) or done % self.plan.steps_per_epoch == 0

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Named tensors saved with this rank's checkpoint, by file name (subclasses)."""
        return {}

    def save_checkpoint(self, metrics: dict[str, Any], suffix: str = "") -> None:
        """Every rank writes its part; Ray Train merges them into one checkpoint directory
        (named alike on every rank)."""
        from ray.train import Checkpoint

        # In /tmp, not under run.output_dir (which may be a network file system); a worker killed while
        # it stages leaves the directory, which the next save on this machine removes (core.scratch).
        with scratch_dir(self.ckpt_prefix) as tmp:
            checkpoint.save(self.engine, tmp, self.state, self.rank, self.plan.as_dict(), self.checkpoint_tensors())
            self.report(metrics, checkpoint=Checkpoint.from_directory(tmp),
                        checkpoint_dir_name=f"step_{self.state.step:08d}{suffix}")

    def end_checkpoint(self, metrics: dict[str, Any]) -> None:
        """The run's last report: closes the log, then a checkpoint named uniquely even when a
        finished run is run again (it re-evaluates and re-exports)."""
        self.log.close()
        suffix = self.comm.broadcast(f"_end_{uuid.uuid4().hex[:8]}" if self.rank == 0 else None)
        self.save_checkpoint(metrics, suffix)
