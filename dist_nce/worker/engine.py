"""DeepSpeed engine construction from a JSON config in configs/deepspeed/.

The JSONs leave the batch geometry and the clipping as ``"auto"`` (the Hugging Face Trainer
convention) so one file serves every cluster size and the YAML is the one place for them: the
trainer fills in the micro batch from ``optim.batch_size / num_workers`` and ``gradient_clipping``
from ``optim.grad_clip``. A number in the JSON that disagrees with the YAML is refused, naming both
keys, as the Trainer refuses one that disagrees with its arguments: either silently winning would
train with a setting the user did not ask for. The optimizer and scheduler are plain torch objects
handed to DeepSpeed: naming an optimizer inside the JSON would compile fused_adam on
first use (a minute here, and a frequent installation failure elsewhere). On a GPU the torch
AdamW is ``fused=True`` (one kernel over each flat fp32 partition DeepSpeed hands it, no build).

Where a DeepSpeed step spends time beyond the plain torch step (issue 23: one H100, ZeRO-2 1.3x and
ZeRO-3 2.5x the plain step; read from DeepSpeed 0.19.8's ``runtime/zero/stage_1_and_2.py`` and
``stage3.py`` and counted on a CPU; ``benchmarks/gpu_train.py`` measures it on a GPU) and what the
JSONs and this module do about it. DeepSpeed's costs are per parameter tensor (398 in a BERT-base
pair), paid on the host: a GPU step stays at the plain step's speed while the host issues them
faster than the GPU computes and nothing makes the host wait for the GPU.

* ``bf16.check_grad_overflow`` (DeepSpeed's default: true) makes every ZeRO-1/2 step test each
  gradient tensor for inf/NaN (amax, amin, two isfinite, and/not, an add: ~2,800 tiny kernels)
  and then wait for the answer (``.item()``): the GPU idles while the host issues them, after a
  backward it had to finish first. bf16 has fp32's exponent range and no loss scale, so there
  is no overflow to skip; the plain torch step (``clip_grad_norm_`` + AdamW) does not check
  either. The bf16 JSONs set it false (DeepSpeed's bf16 behaviour before it was configurable).
* ``overlap_comm`` reduces gradients on a side stream and ends the backward with a device
  ``synchronize()``: the host cannot queue the optimizer step (a gradient norm per tensor, ~800
  small kernels, and the copies into and out of the flat fp32 partitions) while the GPU finishes
  the backward. With one worker there is nothing to overlap: :func:`load_deepspeed_config` turns
  it off at ``world_size == 1`` (the JSONs keep it for several workers).
* ZeRO-3 runs hooks before and after the forward and backward of every submodule (fetch, release,
  trace and prefetch bookkeeping: 460 modules in a BERT-base pair). ``zero_optimization.
  leaf_module`` names ``BertLayer`` (by class name; add a model's own layer class to extend it):
  a transformer layer is fetched and released as one unit, one coalesced gather, one hook pair
  per layer instead of ~14. ``memory_efficient_linear: false`` keeps torch's own ``F.linear``:
  the default replaces it process-wide (every model in the worker, not just the engine's) with an
  autograd Function whose backward rounds differently from ZeRO-1/2's (with it off, ZeRO-3's
  losses equal ZeRO-2's). What stays: the step releases every parameter and re-gathers the
  persistent ones (``stage3_param_persistence_threshold``), and the backward ends waiting for
  its reduce stream.
* Gradient buckets of 2e8 elements (were 5e7): one or two reductions per backward for a BERT-base
  pair instead of ~5 (400 MB of bf16 staging per bucket).

What the first H100 run (torch 2.11, DeepSpeed 0.19.8; plain 0.147 s, ZeRO-2 0.166 s, ZeRO-3 0.289 s,
medians) showed, and the two changes made from it:

* The gradient norm for clipping. Both ZeRO optimizers' ``get_grad_norm_direct`` take one norm per
  gradient tensor, each after a copy to fp64 (``g.to(double).norm()``): 395 ``linalg_vector_norm`` + 400
  ``_to_copy`` in the profiled ZeRO-2 step, ~800 of its 1,033 optimizer kernels, issued one by one from
  Python. The optimizer phase took 29 ms (ZeRO-2) and 46 ms (ZeRO-3) against plain's 3.5 ms
  (``clip_grad_norm_`` = one ``_foreach_norm``). :func:`build_engine` gives the ZeRO optimizer a
  ``get_grad_norm_direct`` that takes the same L2 norms with ``torch._foreach_norm`` (fp32 per tensor, like
  ``clip_grad_norm_`` on fp32 gradients; the sum of squares in DeepSpeed's norm dtype) and then does what
  DeepSpeed does with it (all-reduce over the same group, root, -1 for inf/NaN). Only for the L2 norm
  without model/pipeline/expert parallelism; anything else keeps DeepSpeed's own.
* ZeRO-3 on one worker: the forward (70 ms against ZeRO-2's 40 ms: 9 event and 15 stream
  synchronisations) and backward (142 against 96 ms: ~50 ms in the module hooks) gather and release
  every parameter above ``stage3_param_persistence_threshold`` (1e5: every Linear weight) per leaf module,
  and the step releases them all again. With one worker a parameter's partition is the whole tensor, so
  keeping it gathered saves nothing: :func:`load_deepspeed_config` sets the threshold past any tensor at
  ``world_size == 1`` (every parameter persistent: never released, re-gathered in one call after the
  step; costs one bf16 copy of the weights). The JSONs keep 1e5 for several workers.

What the second H100 run (after those two; plain 0.152 s, ZeRO-2 1.03x, ZeRO-3 1.73x, medians) showed: ZeRO-3's
optimizer phase took 57 ms (ZeRO-2 17, plain 3.5) for 104 device kernels and ~6,500 aten ops: host time. Its
step still releases all 394 parameters (``_partition_all_parameters``: a ``record_stream`` and a new empty
``.data`` each) and re-gathers the persistent ones (``_post_step``: a ``.data`` view each, then a host wait
for the device), although with one worker each comes back to the very view it had (the step updates the
partitions in place). The forward (71 against ZeRO-2's 45 ms) and backward (138 against 97 ms) pay the
per-module hooks. Two changes:

* :func:`keep_resident_parameters` (installed by :func:`build_engine`): during ``step()`` a persistent
  parameter whose ``.data`` is its whole partition stays gathered; any other parameter (several workers,
  sharded ones) is released and re-gathered by DeepSpeed as before.
* ``stage3_prefetch_bucket_size: 0`` at ``world_size == 1`` (:func:`load_deepspeed_config`): with every
  parameter persistent there is nothing to prefetch, and the prefetcher's walk of the parameter queue runs in
  every module's pre-forward and pre-backward hook. The JSON keeps DeepSpeed's default for several workers.

The third H100 run (after all of the above; benchmarks/results/gpu_train.json): plain 0.149 s, ZeRO-2 0.90x,
ZeRO-3 1.25x (optimizer phase 22 ms, forward 64, backward 100), losses within bf16 tolerance of the plain step.
What ZeRO-3 keeps paying is its per-module hooks.
"""
from __future__ import annotations

import json
import math
import os
import sys
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
    or scheduler section (we pass torch objects instead), an inconsistent batch, or a micro
    batch or ``gradient_clipping`` that disagrees with ``micro_batch`` / ``grad_clip`` (give
    ``"auto"`` to take them).
    With one worker (``world_size == 1``) ZeRO's ``overlap_comm`` is turned off, and ZeRO-3 keeps every
    parameter persistent and does not prefetch (module docstring).
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
    if accum != 1:
        # Each step of the plan is one optimizer step over optim.batch_size mentions: the workers call
        # engine.step() once per step and the LR schedule counts steps. With accumulation DeepSpeed steps the
        # optimizer every N calls (warm-up and decay stretched N-fold), and its checkpoints keep neither the
        # micro-step count nor the gradients accumulated so far (a resume between boundaries lost them).
        raise ConfigError(
            f"{path}: gradient_accumulation_steps={accum!r}: not supported (each training step is one optimizer "
            f'step over optim.batch_size mentions); set it to 1 or "auto" and put the whole batch in '
            f"optim.batch_size")
    cfg["gradient_accumulation_steps"] = 1
    for key, ours, yaml_key in (("train_micro_batch_size_per_gpu", micro_batch, "optim.batch_size / run.num_workers"),
                                ("gradient_clipping", grad_clip, "optim.grad_clip")):
        given = cfg.get(key, "auto")
        if given == "auto":
            cfg[key] = ours
        elif not isinstance(given, (int, float)) or isinstance(given, bool) or float(given) != float(ours):
            raise ConfigError(
                f'{path}: {key}={given!r} disagrees with {yaml_key}={ours}; set it to "auto" to take '
                f"the YAML's value (the shipped JSONs do), or make the two agree")
    if cfg.get("train_batch_size", "auto") == "auto":
        cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * world_size
    expected = cfg["train_micro_batch_size_per_gpu"] * world_size
    if cfg["train_batch_size"] != expected:
        raise ConfigError(
            f"{path}: train_batch_size={cfg['train_batch_size']} != micro batch "
            f"{cfg['train_micro_batch_size_per_gpu']} x workers {world_size}")
    if zero_stage is not None:
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage: must be 0..3, got {zero_stage}")
        cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    if bf16 is not None:
        cfg.setdefault("bf16", {})["enabled"] = bool(bf16)
    zero = cfg.get("zero_optimization", {})
    if world_size == 1 and zero.get("stage", 0) >= 1:
        # One worker: nothing to overlap, and overlapping costs a device synchronize per backward.
        zero["overlap_comm"] = False
    if world_size == 1 and zero.get("stage", 0) == 3:
        # One worker: a partition is the whole tensor; keep every parameter gathered (module docstring).
        zero.pop("param_persistence_threshold", None)
        zero["stage3_param_persistence_threshold"] = sys.maxsize
        # Nothing left to prefetch then; 0 skips the per-module walk of the parameter queue.
        zero.pop("prefetch_bucket_size", None)
        zero["stage3_prefetch_bucket_size"] = 0
    return cfg


def linear_warmup_decay(total_steps: int, warmup_proportion: float):
    """LR multiplier: linear warm-up then linear decay to 0 (BLINK's schedule)."""
    warmup = int(math.ceil(total_steps * warmup_proportion))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, total_steps: int,
                    warmup_proportion: float):
    """A torch AdamW (no decay on biases and LayerNorm weights, as BERT/BLINK) and its LambdaLR
    (:func:`linear_warmup_decay`); returns (optimizer, scheduler).

    The AdamW is fused (torch's own kernel, nothing compiled) when every trainable parameter is on
    a CUDA device.
    """
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    params = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith(no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    params = [g for g in params if g["params"]]
    fused = bool(params) and all(p.is_cuda for g in params for p in g["params"])
    optimizer = torch.optim.AdamW(params, lr=lr, fused=True) if fused else torch.optim.AdamW(params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(total_steps, warmup_proportion))
    return optimizer, scheduler


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_proportion: float,
    dist_init_required: bool = False,
):
    """``deepspeed.initialize`` with :func:`build_optimizer`'s AdamW and LambdaLR; returns (engine,
    optimizer, scheduler).

    ``dist_init_required=False`` inside Ray Train, which has already made the process group.
    The AdamW is fused when the engine's fp32 master partitions are on a CUDA device. The ZeRO
    optimizer gets the one-call clipping norm (:func:`foreach_grad_norm`) and, ZeRO-3, a step that
    leaves parameters which are their own partition gathered (:func:`keep_resident_parameters`).
    """
    from dist_nce.cluster.runtime import import_deepspeed, pin_jit_builds, skip_deepspeed_shm_op

    pin_jit_builds()  # before deepspeed builds any JIT op
    skip_deepspeed_shm_op()  # before deepspeed.comm starts its backend
    deepspeed = import_deepspeed()

    defer_muon_compile()

    optimizer, scheduler = build_optimizer(model, lr, weight_decay, total_steps, warmup_proportion)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        dist_init_required=dist_init_required,
    )
    foreach_grad_norm(optimizer)
    keep_resident_parameters(optimizer)
    return engine, optimizer, scheduler


def defer_muon_compile() -> None:
    """Import DeepSpeed's Muon optimizer module with its ``torch.compile`` deferred to first call.

    DeepSpeed imports that module on its ZeRO and bf16 paths whatever the optimizer (to test
    ``isinstance(optimizer, MuonWithAuxAdam)``), and the module ``torch.compile``s three kernels
    as it is imported, which imports inductor: 4-6 s of CPU in every process that builds an
    engine, each Ray Train worker included (measured: ``import torch`` 2.3 s; that module after
    torch and deepspeed, 4.5 s). Imported here with DeepSpeed's compile helper swapped for one
    that compiles on the first call, Muon, if anyone uses it, still runs compiled; nobody else
    pays for the compiler.
    """
    import importlib

    name = "deepspeed.runtime.zero.muon.original_muon"
    if name in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile
    compiler.compile = _compile_on_first_call
    try:
        importlib.import_module(name)
    finally:
        compiler.compile = eager


def _compile_on_first_call():
    """A decorator like ``torch.compile`` that compiles when the function is first called."""
    import functools

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


def keep_resident_parameters(zero_optimizer) -> bool:
    """Skip ZeRO-3's release + re-gather, in ``step()``, of parameters that are their own partition (module docstring).

    DeepSpeed 0.19's ``DeepSpeedZeroOptimizer_Stage3.step`` starts by releasing every parameter
    (``_partition_all_parameters``: per parameter a ``record_stream`` and a new empty ``.data``) and ends by
    re-gathering the persistent ones (``_post_step``: per parameter a ``.data`` view of its partition, then a
    host wait for the device). A persistent parameter whose ``.data`` already is its whole partition (same
    storage, same first element, same size: one worker) comes back to exactly the view it had, since the step
    updates the partitions in place (fp32 master -> the bf16 flat buffer the partitions view). This wraps
    ``step``: during it such parameters stay gathered; everything else (sharded parameters, several workers)
    is released and re-gathered by DeepSpeed as before. Before the re-gather, a kept parameter whose partition
    was moved is pointed at it again (what the gather would do). Other callers of ``_partition_all_parameters``
    (checkpoint save/load) keep DeepSpeed's own. Returns whether it was installed (ZeRO-3 only).
    """
    offload = getattr(zero_optimizer, "parameter_offload", None)
    if offload is None or getattr(zero_optimizer, "_keep_resident_parameters", False):
        return False
    coordinator = offload.get_param_coordinator()
    release = getattr(coordinator, "_PartitionedParameterCoordinator__release_param", None)
    inflight = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry", None)
    if release is None or inflight is None:
        return False  # another DeepSpeed: keep its own
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    module = offload.module
    original_step = zero_optimizer.step
    original_partition_all = zero_optimizer._partition_all_parameters
    original_post_step = zero_optimizer._post_step
    kept: list = []

    def is_own_partition(param) -> bool:
        part = getattr(param, "ds_tensor", None)
        return (getattr(param, "ds_persist", False) and param.ds_status == ZeroParamStatus.AVAILABLE
                and part is not None and part.device == param.data.device
                and part.data_ptr() == param.data.data_ptr() and part.numel() == param.data.numel()
                and param.data.is_contiguous())

    def partition_all_parameters():
        if not zero_optimizer._in_step_keep_resident:
            return original_partition_all()
        kept.clear()
        # DeepSpeed's release_and_reset_all, less the release of parameters that are their own partition.
        for param in iter_params(module, recurse=True):
            if param in inflight:
                inflight.pop(param).wait()
            param.ds_active_sub_modules.clear()
            if is_own_partition(param):
                kept.append(param)
            else:
                release(param)
        kept_ids = {id(p) for p in kept}
        for param in iter_params(module, recurse=True):
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE and id(param) not in kept_ids:
                raise RuntimeError(f"{param.ds_summary()} expected to be released")

    def post_step(timer_names):
        for param in kept:
            part = param.ds_tensor
            if part.data_ptr() != param.data.data_ptr() or part.numel() != param.data.numel():
                param.data = part.data.view(param.ds_shape)
        kept.clear()
        return original_post_step(timer_names)

    def step(*args, **kwargs):
        zero_optimizer._in_step_keep_resident = True
        try:
            return original_step(*args, **kwargs)
        finally:
            zero_optimizer._in_step_keep_resident = False
            kept.clear()

    zero_optimizer._in_step_keep_resident = False
    zero_optimizer._partition_all_parameters = partition_all_parameters
    zero_optimizer._post_step = post_step
    zero_optimizer.step = step
    zero_optimizer._keep_resident_parameters = True
    return True


def foreach_grad_norm(zero_optimizer) -> bool:
    """Give a ZeRO optimizer a ``get_grad_norm_direct`` built on ``torch._foreach_norm`` (module docstring).

    DeepSpeed 0.19's ZeRO-1/2 (``stage_1_and_2.py``) and ZeRO-3 (``stage3.py``) take the clipping norm as one
    ``g.to(float64).norm()`` per gradient tensor: ~2 kernels and a Python round per tensor. This takes the
    per-tensor L2 norms in one multi-tensor call (fp32, as ``clip_grad_norm_``), sums their squares in
    DeepSpeed's norm dtype, and then does what DeepSpeed's does: all-reduce over the data-parallel (ZeRO-3:
    the parameters' partition) group, square root, -1 for an inf/NaN norm. Returns whether it was installed:
    not for an optimizer without that method (ZeRO-0, BF16_Optimizer), with model parallelism or pipeline-
    replicated parameters; per call, a norm other than L2 or AutoEP expert parameters go to DeepSpeed's own.
    """
    original = getattr(zero_optimizer, "get_grad_norm_direct", None)
    if original is None or getattr(zero_optimizer, "_foreach_grad_norm", False):
        return False
    if getattr(zero_optimizer, "model_parallel_group", None) is not None:
        return False
    groups = getattr(zero_optimizer, "bit16_groups", None) or getattr(zero_optimizer, "fp16_groups", None) or []
    if any(getattr(p, "ds_pipe_replicated", False) for g in groups for p in g):
        return False
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    stage3 = hasattr(zero_optimizer, "_get_param_partition_group")

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or not params:
            return original(gradients, params, norm_type)
        if stage3:
            autoep = getattr(zero_optimizer, "_autoep_expert_parallel_group", None)
            if autoep is not None and autoep(params) is not None:
                return original(gradients, params, norm_type)
            group = zero_optimizer._get_param_partition_group(params[0])
        else:
            group = zero_optimizer.dp_process_group
        grads = [g.detach() for g in gradients if not getattr(g, "_zero_padding", False)]
        device = getattr(zero_optimizer, "device", None)
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = torch.stack(norms).to(get_norm_dtype()).square().sum()
        else:
            total = torch.zeros((), dtype=get_norm_dtype(), device=device)
        if not stage3:
            total = total.float()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        total = total.sqrt()
        return torch.where(total.isinf() | total.isnan(), torch.full_like(total, -1.0), total)

    zero_optimizer.get_grad_norm_direct = get_grad_norm_direct
    zero_optimizer._foreach_grad_norm = True
    return True
