"""DeepSpeed engine construction from a JSON config in configs/deepspeed/.

The JSONs leave the batch geometry as ``"auto"`` (the Hugging Face Trainer convention)
so one file serves every cluster size: the trainer fills in the micro batch from
``optim.batch_size / num_workers``. The optimizer and scheduler are plain torch objects
handed to DeepSpeed: naming an optimizer inside the JSON would compile fused_adam on
first use (a minute here, and a frequent installation failure elsewhere).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from dist_nce.core.config import ConfigError

# Keys we read or fill; anything else is passed to DeepSpeed untouched (it validates them).
_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")


def load_deepspeed_config(
    path: str | os.PathLike,
    micro_batch: int,
    world_size: int,
    grad_clip: float,
    zero_stage: int | None = None,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Read a DeepSpeed JSON, fill ``"auto"`` fields and apply overrides.

    Raises ConfigError naming the file for a missing file, invalid JSON, an optimizer
    or scheduler section (we pass torch objects instead), or an inconsistent batch.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: DeepSpeed config not found")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ConfigError(
                f"{path}: {key}: not supported; dist-nce passes a torch optimizer/scheduler "
                f"configured by the `optim` section (avoids compiling fused ops)")
    accum = cfg.get("gradient_accumulation_steps", 1)
    if accum == "auto":
        accum = 1
    cfg["gradient_accumulation_steps"] = int(accum)
    if cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if cfg.get("train_batch_size", "auto") == "auto":
        cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * accum * world_size
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = grad_clip
    expected = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world_size
    if cfg["train_batch_size"] != expected:
        raise ConfigError(
            f"{path}: train_batch_size={cfg['train_batch_size']} != micro batch "
            f"{cfg['train_micro_batch_size_per_gpu']} x accumulation {accum} x workers {world_size}")
    if zero_stage is not None:
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage: must be 0..3, got {zero_stage}")
        cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    if bf16 is not None:
        cfg.setdefault("bf16", {})["enabled"] = bool(bf16)
    return cfg


def linear_warmup_decay(total_steps: int, warmup_proportion: float):
    """LR multiplier: linear warm-up then linear decay to 0 (BLINK's schedule)."""
    warmup = int(math.ceil(total_steps * warmup_proportion))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_proportion: float,
    dist_init_required: bool = False,
):
    """``deepspeed.initialize`` with a torch AdamW and a LambdaLR; returns (engine, optimizer, scheduler).

    ``dist_init_required=False`` inside Ray Train, which has already made the process group.
    """
    from dist_nce.cluster.runtime import pin_jit_builds

    pin_jit_builds()  # before deepspeed.comm builds its CPU shm op
    import deepspeed

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith(no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    params = [g for g in params if g["params"]]
    optimizer = torch.optim.AdamW(params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(total_steps, warmup_proportion))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        dist_init_required=dist_init_required,
    )
    return engine, optimizer, scheduler
