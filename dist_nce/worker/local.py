"""A training worker in this process alone, with plain torch: no Ray, no DeepSpeed.

For one GPU (or a CPU) on a machine that has neither installed, and as the reference the
DeepSpeed workers are tested against. :class:`LocalEngine` is the part of a DeepSpeed engine
the workers call (forward, ``backward``, ``step``, the two queries of ``engine_info``);
:class:`LocalWorker`, mixed in before a worker class, builds one instead of
``deepspeed.initialize`` and writes no checkpoints, so a local run cannot be resumed.

What differs from the DeepSpeed path, by design:

* bf16 is torch autocast over fp32 weights (DeepSpeed's bf16 engine keeps bf16 weights and
  fp32 master copies in the optimizer): the same matmul precision, other rounding;
* clipping is ``torch.nn.utils.clip_grad_norm_`` at ``optim.grad_clip``, as
  DeepSpeed's ZeRO-0 (whose norm sums squared norms: the same number up to rounding).

With fp32 on a CPU the two paths take the same steps (tests/rerank/test_rerank_local.py).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from dist_nce.worker.engine import build_optimizer, load_deepspeed_config


class LocalEngine:
    """``module`` with the AdamW + schedule of :func:`~dist_nce.worker.engine.build_optimizer`."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 grad_clip: float, bf16: bool):
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.grad_clip, self.bf16 = grad_clip, bf16

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        device = next(self.module.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    def __call__(self, *args, **kwargs):
        with self._autocast():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        """Clip, update, advance the schedule, clear the gradients: one optimizer step."""
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_optimization_stage(self) -> int:
        return 0

    def bfloat16_enabled(self) -> bool:
        return self.bf16


class LocalWorker:
    """Mixin: ``class LocalRerankWorker(LocalWorker, RerankWorker)``; construct it with rank 0,
    world 1 and a device, then ``run()``."""

    def make_engine(self, model: torch.nn.Module) -> None:
        cfg = self.cfg
        if self.world != 1:
            raise ValueError(f"a local worker runs alone (world 1), got world {self.world}")
        # The DeepSpeed JSON still decides bf16 and clipping (with their overrides), so one config
        # reads the same on both paths; its ZeRO stage has no meaning here.
        ds = load_deepspeed_config(cfg.deepspeed.config, self.plan.per_worker_batch, 1, cfg.optim.grad_clip,
                                   cfg.deepspeed.zero_stage, cfg.deepspeed.bf16)
        module = model.to(self.device)
        optimizer, scheduler = build_optimizer(module, cfg.optim.lr, cfg.optim.weight_decay, self.plan.total_steps,
                                               cfg.optim.warmup_proportion)
        # gradient_clipping is optim.grad_clip (the JSON says "auto" or the same number).
        self.engine = LocalEngine(module, optimizer, scheduler, float(ds.get("gradient_clipping", 0.0)),
                                  bool(ds.get("bf16", {}).get("enabled", False)))
        self.optimizer, self.scheduler, self.module = optimizer, scheduler, module
        self.zero3 = False
        self.accelerator = None  # no DeepSpeed accelerator

    def engine_info(self) -> dict[str, Any]:
        return {**super().engine_info(), "backend": "local"}

    def save_checkpoint(self, metrics: dict[str, Any], suffix: str = "") -> None:
        """No checkpoints: a local run is not resumable (Ray Train keeps the DeepSpeed runs')."""
