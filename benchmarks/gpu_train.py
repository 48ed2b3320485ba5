"""One dual-retriever training step on one device: plain torch against the project's DeepSpeed engine
(issue 23, item 4: "DeepSpeed on a GPU at the plain step's speed").

The model is the project's own :class:`~dist_nce.modeling.retriever.Retriever` (preset ``dual``: BLINK's
[CLS] inner product) with BERT-base on both sides, built from a config dict (random init, nothing is
downloaded), trained on the NCE loss of :func:`dist_nce.modeling.losses.nce_loss` (gold in column 0) over a
batch of B mentions x K candidates, as ``dist_nce/train/loop.py`` does. Modes, measured in the same process
and interleaved (A B C A B C ...) after warm-up, from the SAME initial weights on the SAME batches:

* ``plain``: fp32 master weights, ``torch.autocast(bf16)``, ``clip_grad_norm_(1.0)``, AdamW (``fused=True``
  on CUDA), the engine's LambdaLR schedule and parameter groups;
* ``zero2`` / ``zero3``: :func:`dist_nce.worker.engine.build_engine` with configs/deepspeed/zero2_bf16.json /
  zero3_bf16.json (the configs the trainer runs: bf16 weights, fp32 master weights in the ZeRO optimizer,
  gradient clipping 1.0);
* with ``compare_before=True``: ``zero2_before`` / ``zero3_before``, the configs as they were when issue 23
  was measured (:data:`ISSUE_23_CONFIGS`), so one run shows what the config changes bought.

Per mode: step time min / median / max (device synchronised before and after each step), where the step's
time goes (``phases``: forward / backward / optimizer step; on CUDA the GPU time between events recorded at
the phase boundaries and the host time to issue each phase), model FLOPs utilisation (:data:`MFU_FORMULA`)
against ``peak_tflops``, peak device memory, the loss of every step and the largest |loss - plain loss|, and
the ratio of its median step to plain's. With ``profile=True`` one more step per mode runs under
``torch.profiler`` and reports kernel launches, device synchronisations and the busiest host-side ops.

Where DeepSpeed's time went (DeepSpeed 0.19.8 source; the fixes are in configs/deepspeed/*.json, see
``docs/design.md``'s DeepSpeed note and :data:`ISSUE_23_CONFIGS` for what changed):

* ZeRO-1/2 with bf16: ``bf16.check_grad_overflow`` defaults to true, so every ``step()`` first runs
  ``has_overflow_partitioned_grads_serial``: per gradient tensor an amax, an amin, two isfinite, a logical
  and/not and an add (~400 tensors for two BERT-base encoders, ~3,000 tiny kernels, launch-bound: the GPU
  idles while the host issues them), then a ``.item()`` that waits for the whole backward. bf16 has fp32's
  range and no loss scale, so there is no overflow to detect that the gradient norm does not see:
  configs set it false (the plain step has no such check either: ``clip_grad_norm_`` of a non-finite norm
  makes the step non-finite in both).
* ``overlap_comm: true`` on the gradient buckets: each bucket reduction (``allreduce_and_copy``) starts with
  a full ``device synchronize()``; with one rank there is no communication to overlap, and with several ranks
  on NCCL the reductions overlap the backward only between those host stalls. ``reduce_bucket_size`` 5e7
  elements meant ~5 such stalls per backward (2 x 110M parameters), each draining the GPU queue. The
  configs now use 2e8-element buckets (one or two reductions per backward; 400 MB of bf16 staging per
  bucket, doubled by ``overlap_comm``), and ZeRO-2 keeps ``overlap_comm`` for multi-GPU runs where NCCL
  time is real; on one GPU (``world_size=1``) the engine turns ``overlap_comm`` off
  (:func:`dist_nce.worker.engine.load_deepspeed_config`): there is nothing to overlap.
* ZeRO-3: every module's forward and backward gathers its partitioned parameters (with one rank a copy of
  the whole parameter) and releases them after, through per-module hooks and the prefetch coordinator.
  Parameters under ``stage3_param_persistence_threshold`` stay gathered; the configs raise it from 1e5 to
  1e6 elements, so the 768x768 and 768x3072 BERT-base matrices (590k and 2.36M elements) are... the
  768x768 ones persist, and ``stage3_prefetch_bucket_size`` 5e7 and ``stage3_max_live_parameters`` 1e9 keep a
  layer or more in flight. With one rank a partition is the whole parameter, so gathering saves nothing:
  the engine makes every parameter persistent there (``stage3_param_persistence_threshold`` and
  ``stage3_model_persistence_threshold`` above the model's size), which leaves the fp32 master weights and
  optimizer state partitioned (ZeRO-3's saving at world size 1 is nil anyway).

FLOPs (:data:`MFU_FORMULA`): 6 x (parameters of the encoders' matrix multiplies) x tokens for forward +
backward, plus attention's QK^T and AV (12 x layers x T^2 x d per sequence of T tokens, forward + backward);
embeddings, the frozen pooler and the [CLS] scores are left out (under 0.1%).

Run (one GPU; prints the result as JSON)::

    .venv/bin/python -m benchmarks.gpu_train                  # BERT-base, B=8, K=64, 128 tokens; ~1-2 min on H100
    .venv/bin/python -m benchmarks.gpu_train --quick --device cpu   # the test-sized form (tests/benchmarks)

Environment: DeepSpeed needs a torch.distributed process group; when none exists one is made for world size 1
on loopback (MASTER_ADDR=127.0.0.1 and a free MASTER_PORT unless set; RANK, LOCAL_RANK, WORLD_SIZE default
to 0, 0, 1). ``DS_ACCELERATOR`` is set to ``cuda`` or ``cpu`` to match ``device`` unless already set.
Neither ray nor faiss is imported.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
DS_DIR = REPO / "configs" / "deepspeed"
DEFAULT_CONFIGS = {"zero2": str(DS_DIR / "zero2_bf16.json"), "zero3": str(DS_DIR / "zero3_bf16.json")}

# configs/deepspeed/zero{2,3}_bf16.json as issue 23 measured them (0.193 s and 0.376 s against 0.149 s plain).
ISSUE_23_CONFIGS: dict[str, dict[str, Any]] = {
    "zero2_before": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
        "steps_per_print": 1000000, "wall_clock_breakdown": False},
    "zero3_before": {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000,
                              "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_param_persistence_threshold": 100000},
        "steps_per_print": 1000000, "wall_clock_breakdown": False},
}

MFU_FORMULA = ("flops_per_step = 6 * matmul_params * tokens + 12 * layers * T^2 * d * sequences (per side: "
               "matmul_params = weights of the encoder layers' Linear modules, tokens = sequences * T); "
               "mfu = flops_per_step / step_seconds_median / (peak_tflops * 1e12)")

BERT_BASE = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TINY_BERT = {**BERT_BASE, "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 64}

FULL = {"mentions": 8, "candidates": 64, "mention_len": 32, "cand_len": 128, "warmup": 3, "steps": 15}
QUICK = {"mentions": 2, "candidates": 4, "mention_len": 8, "cand_len": 16, "warmup": 1, "steps": 3}

LR, WEIGHT_DECAY, WARMUP_PROPORTION, GRAD_CLIP = 2e-5, 0.01, 0.1, 1.0  # the optim section's defaults (wd: both groups)


# --------------------------------------------------------------------------- model, batches, FLOPs


def build_model(bert: dict[str, Any], seed: int):
    """The project's dual retriever with two randomly initialised transformers from ``bert`` (fp32, CPU)."""
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    torch.manual_seed(seed)
    return Retriever(RetrieverConfig(preset="dual"), Encoder.from_config(bert), Encoder.from_config(bert)).train()


def make_batches(n: int, shape: dict[str, int], vocab: int, device: str, seed: int) -> list[tuple]:
    """``n`` batches (mention_ids [B, Lm], mention_mask, cand_ids [B, K, Lc], cand_mask): every token real, so
    no column is trimmed and the FLOP count is exact; [CLS]=101 first as BLINK lays them out."""
    g = torch.Generator().manual_seed(seed)
    b, k, lm, lc = shape["mentions"], shape["candidates"], shape["mention_len"], shape["cand_len"]
    out = []
    for _ in range(n):
        m = torch.randint(1000 if vocab > 2000 else 2, vocab, (b, lm), generator=g)
        c = torch.randint(1000 if vocab > 2000 else 2, vocab, (b, k, lc), generator=g)
        m[:, 0] = c[..., 0] = min(101, vocab - 1)
        out.append(tuple(t.to(device) for t in (m, torch.ones_like(m), c, torch.ones_like(c))))
    return out


def step_flops(model, shape: dict[str, int]) -> dict[str, Any]:
    """Model FLOPs of one forward + backward (:data:`MFU_FORMULA`)."""
    total, parts = 0, {}
    for side, enc, seqs, t in (("mention", model.mention_encoder, shape["mentions"], shape["mention_len"]),
                               ("entity", model.entity_encoder, shape["mentions"] * shape["candidates"],
                                shape["cand_len"])):
        cfg = enc.model.config
        matmul = sum(m.weight.numel() for m in enc.model.encoder.modules() if isinstance(m, torch.nn.Linear))
        dense = 6 * matmul * seqs * t
        attention = 12 * cfg.num_hidden_layers * t * t * cfg.hidden_size * seqs
        parts[side] = {"matmul_params": matmul, "tokens": seqs * t, "dense_flops": dense, "attention_flops": attention}
        total += dense + attention
    return {"flops_per_step": total, "sides": parts, "formula": MFU_FORMULA}


def device_peak_tflops(device: str) -> tuple[float, str]:
    """bf16 matmul rate of ``device`` now (best of several products after warm-up), TFLOP/s."""
    n, reps = (8192, 20) if device.startswith("cuda") else (256, 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12, f"measured here: bf16 matmul {n}^3, best of {reps}"


# --------------------------------------------------------------------------- modes


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Mode:
    """One way to train: ``forward(batch) -> loss``, ``backward(loss)``, ``step()``."""

    name: str

    def forward(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Plain(Mode):
    name = "plain"

    def __init__(self, model, device: str, total_steps: int):
        from dist_nce.worker.engine import linear_warmup_decay

        self.device_type = device.split(":")[0]
        self.model = model.to(device)
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")  # build_engine's groups
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0}]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR,
                                     fused=self.device_type == "cuda")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, linear_warmup_decay(total_steps, WARMUP_PROPORTION))

    def forward(self, batch):
        from dist_nce.modeling.losses import nce_loss

        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            scores = self.model(*batch)
        return nce_loss(scores.float())

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)


class Engine(Mode):
    """The trainer's path: ``build_engine`` + ``engine(...)``, ``engine.backward``, ``engine.step``."""

    def __init__(self, name: str, model, device: str, ds_config: dict, total_steps: int):
        from dist_nce.worker.engine import build_engine

        self.name = name
        self.config = ds_config
        self.engine, self.optimizer, _ = build_engine(model.to(device), ds_config, lr=LR, weight_decay=WEIGHT_DECAY,
                                                      total_steps=total_steps,
                                                      warmup_proportion=WARMUP_PROPORTION,
                                                      dist_init_required=False)

    def forward(self, batch):
        from dist_nce.modeling.losses import nce_loss

        return nce_loss(self.engine(*batch).float())

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def close(self):
        try:
            self.engine.destroy()
        except Exception:  # noqa: BLE001 - best effort: the process ends soon after
            pass
        self.engine = self.optimizer = None


def _ensure_process_group(device: str) -> str:
    import torch.distributed as dist

    from dist_nce.cluster.runtime import single_process_dist_env

    for k, v in single_process_dist_env().items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_backend()


def _import_deepspeed(device: str) -> str | None:
    """None when deepspeed is usable for ``device``, else why not."""
    want = "cuda" if device.startswith("cuda") else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", want)
    try:
        from dist_nce.cluster.runtime import pin_jit_builds

        pin_jit_builds()
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything at import
        return f"deepspeed cannot be imported: {type(e).__name__}: {e}"
    got = get_accelerator().device_name()
    if got != want:
        return f"deepspeed's accelerator is {got!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}), not {want!r}"
    return None


# --------------------------------------------------------------------------- timing


class _Phases:
    """Phase boundaries of one step: host perf_counter always, CUDA events on a GPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.host: list[float] = []
        self.events: list[Any] = []

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)

    def result(self) -> dict[str, dict[str, float]]:
        names = ("forward", "backward", "optimizer")
        out = {"host_ms": {n: 1e3 * (b - a) for n, a, b in zip(names, self.host, self.host[1:])}}
        if self.cuda:
            out["device_ms"] = {n: a.elapsed_time(b) for n, a, b in zip(names, self.events, self.events[1:])}
        return out


def _one_step(mode: Mode, batch, device: str) -> dict[str, Any]:
    ph = _Phases(device)
    _sync(device)
    t0 = time.perf_counter()
    ph.mark()
    loss = mode.forward(batch)
    ph.mark()
    mode.backward(loss)
    ph.mark()
    mode.step()
    ph.mark()
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "loss": float(loss.detach()), **ph.result()}


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _profile_step(mode: Mode, batch, device: str) -> dict[str, Any]:
    """One step under torch.profiler: kernel launches, synchronisations, busiest host ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    with profile(activities=acts) as prof:
        loss = mode.forward(batch)
        mode.backward(loss)
        mode.step()
        _sync(device)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernelEx"))
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or e.key == "cudaStreamWaitEvent"}
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"kernel_launches": launches, "aten_ops": aten, "synchronizations": syncs,
            "top_host_ops": [{"op": e.key, "count": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 3)}
                             for e in top]}


# --------------------------------------------------------------------------- the run


def run(device: str = "cuda", quick: bool = False, peak_tflops: float | None = None, *,
        steps: int | None = None, warmup: int | None = None, configs: dict[str, Any] | None = None,
        compare_before: bool = False, profile: bool | None = None, seed: int = 0,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure plain torch vs the project's DeepSpeed engine on ``device`` (see the module docstring).

    ``quick``: a tiny BERT (2 layers, hidden 64) and a small batch, for CPU tests. ``steps`` / ``warmup``:
    timed / untimed interleaved rounds (default 15 / 3, quick 3 / 1). ``configs``: name -> DeepSpeed JSON
    path or dict (default :data:`DEFAULT_CONFIGS`); ``compare_before`` adds :data:`ISSUE_23_CONFIGS`.
    ``profile`` (default: on for CUDA) runs one extra profiled step per mode. Errors of one mode (an
    out-of-memory, a DeepSpeed failure) are recorded in its entry and the other modes go on.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    shape = dict(QUICK if quick else FULL)
    shape["steps"] = steps if steps is not None else shape["steps"]
    shape["warmup"] = warmup if warmup is not None else shape["warmup"]
    bert = TINY_BERT if quick else BERT_BASE
    is_cuda = device.startswith("cuda")
    profile = is_cuda if profile is None else profile
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 ops outside autocast (the plain step's optimizer)
        torch.backends.cudnn.allow_tf32 = True
    total_steps = shape["warmup"] + shape["steps"]

    result: dict[str, Any] = {
        "benchmark": "gpu_train (issue 23 item 4)", "device": device, "quick": quick,
        "device_name": torch.cuda.get_device_name(device) if is_cuda else platform.processor() or platform.machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "transformers": __import__("transformers").__version__},
        "model": {"retriever": "dual", "bert": bert}, "batch": {k: shape[k] for k in
                                                                 ("mentions", "candidates", "mention_len", "cand_len")},
        "rounds": {"warmup": shape["warmup"], "timed": shape["steps"], "order": "interleaved A B C A B C ..."},
        "optim": {"lr": LR, "weight_decay": WEIGHT_DECAY, "warmup_proportion": WARMUP_PROPORTION,
                  "grad_clip": GRAD_CLIP, "schedule": "linear warm-up + decay over warmup+timed steps"},
        "modes": {},
    }
    if peak_tflops is None:
        peak_tflops, source = device_peak_tflops(device)
    else:
        source = "caller"
    result["peak_tflops"], result["peak_source"] = float(peak_tflops), source

    base = build_model(bert, seed)
    flops = step_flops(base, shape)
    result["flops"] = flops
    batches = make_batches(total_steps + (1 if profile else 0), shape, bert["vocab_size"], device, seed + 1)

    wanted = dict(DEFAULT_CONFIGS if configs is None else configs)
    if compare_before:
        wanted.update(ISSUE_23_CONFIGS)
    modes: dict[str, Mode] = {}
    resident: dict[str, int] = {}
    entries: dict[str, dict[str, Any]] = result["modes"]

    def alloc() -> int:
        return torch.cuda.memory_allocated(device) if is_cuda else 0

    a0 = alloc()
    modes["plain"] = Plain(copy.deepcopy(base), device, total_steps)
    resident["plain"] = alloc() - a0
    entries["plain"] = {"kind": "plain torch: fp32 weights, bf16 autocast, clip_grad_norm_, AdamW"
                                + (" fused" if is_cuda else "")}
    skip = _import_deepspeed(device)
    if skip is None:
        try:
            result["process_group"] = _ensure_process_group(device)
            import deepspeed

            result["versions"]["deepspeed"] = deepspeed.__version__
        except Exception as e:  # noqa: BLE001
            skip = f"no process group for DeepSpeed: {type(e).__name__}: {e}"
    for name, cfg in wanted.items():
        if skip is not None:
            entries[name] = {"skipped": skip}
            continue
        try:
            from dist_nce.worker.engine import load_deepspeed_config

            ds = _load_config(cfg, load_deepspeed_config, shape["mentions"])
            a0 = alloc()
            modes[name] = Engine(name, copy.deepcopy(base), device, ds, total_steps)
            resident[name] = alloc() - a0
            entries[name] = {"kind": "dist_nce.worker.engine.build_engine", "config": cfg if isinstance(cfg, str)
                             else "inline", "ds_config": ds}
        except Exception as e:  # noqa: BLE001
            entries[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            log(f"{name}: engine not built: {e}")
    del base
    result["setup_seconds"] = time.perf_counter() - t_start
    log(f"modes {list(modes)} built in {result['setup_seconds']:.1f} s; {total_steps} rounds")

    records: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    peaks: dict[str, int] = {name: 0 for name in modes}
    for rnd in range(total_steps):
        for name in list(modes):
            mode = modes[name]
            try:
                before = alloc()
                if is_cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                rec = _one_step(mode, batches[rnd], device)
                if is_cuda:
                    peaks[name] = max(peaks[name], resident[name] + torch.cuda.max_memory_allocated(device) - before)
                resident[name] += alloc() - before
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: drop this mode, keep the others
                entries[name]["error"] = f"step {rnd}: {type(e).__name__}: {e}"
                entries[name]["traceback"] = traceback.format_exc()[-3000:]
                log(f"{name}: dropped at step {rnd}: {e}")
                mode.close()
                del modes[name]
                if is_cuda:
                    torch.cuda.empty_cache()
                continue
            rec["timed"] = rnd >= shape["warmup"]
            records[name].append(rec)
        if rnd == 0 or rnd == total_steps - 1:
            log(f"round {rnd}: " + ", ".join(f"{n} {records[n][-1]['seconds']:.3f} s loss {records[n][-1]['loss']:.4f}"
                                             for n in modes if records[n]))

    plain_losses = [r["loss"] for r in records.get("plain", [])]
    peak = float(peak_tflops) * 1e12
    for name, recs in records.items():
        e = entries[name]
        timed = [r for r in recs if r["timed"]]
        e["losses"] = [r["loss"] for r in recs]
        if name != "plain" and plain_losses:
            n = min(len(plain_losses), len(recs))
            diffs = [abs(a - b) for a, b in zip(e["losses"][:n], plain_losses[:n])]
            e["max_abs_loss_diff_vs_plain"] = max(diffs) if diffs else None
            e["first_step_abs_loss_diff_vs_plain"] = diffs[0] if diffs else None
        if not timed:
            continue
        secs = [r["seconds"] for r in timed]
        e["step_seconds"] = _spread(secs)
        e["tflops_per_s"] = flops["flops_per_step"] / e["step_seconds"]["median"] / 1e12
        e["mfu"] = flops["flops_per_step"] / e["step_seconds"]["median"] / peak
        e["phases_median"] = {kind: {ph: statistics.median(r[kind][ph] for r in timed)
                                     for ph in ("forward", "backward", "optimizer")}
                              for kind in ("host_ms", "device_ms") if kind in timed[0]}
        e["peak_memory_bytes"] = peaks[name] if is_cuda else None
        e["peak_memory_gib"] = peaks[name] / 2 ** 30 if is_cuda else None
        e["resident_bytes_after"] = resident[name] if is_cuda else None
    if "plain" in records and records["plain"]:
        base_med = entries["plain"]["step_seconds"]["median"]
        for name in records:
            if "step_seconds" in entries[name]:
                s = entries[name]["step_seconds"]
                entries[name]["ratio_to_plain"] = s["median"] / base_med
                entries[name]["ratio_to_plain_range"] = [s["min"] / entries["plain"]["step_seconds"]["max"],
                                                         s["max"] / entries["plain"]["step_seconds"]["min"]]
    if profile:
        for name, mode in modes.items():
            try:
                entries[name]["profile"] = _profile_step(mode, batches[total_steps], device)
            except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
                entries[name]["profile"] = {"error": f"{type(e).__name__}: {e}"}
    for mode in modes.values():
        mode.close()
    result["memory_note"] = ("peak_memory: what the mode holds (weights, optimizer state, buffers: the allocations "
                             "it made since it was built) + the most one of its steps allocated on top; "
                             "the other modes' memory is not counted" if is_cuda else
                             "no device memory figures on CPU")
    result["seconds"] = time.perf_counter() - t_start
    return result


def _load_config(cfg: str | dict, loader, micro_batch: int) -> dict:
    """A JSON path through the engine's own loader; a dict through the same loader (via a temporary file)."""
    if isinstance(cfg, dict):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        try:
            return loader(f.name, micro_batch=micro_batch, world_size=1, grad_clip=GRAD_CLIP)
        finally:
            os.unlink(f.name)
    return loader(cfg, micro_batch=micro_batch, world_size=1, grad_clip=GRAD_CLIP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny BERT, small batch, 3 timed steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: measure a bf16 matmul)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--compare-before", action="store_true", help="also the configs issue 23 measured")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    res = run(args.device, args.quick, args.peak_tflops, steps=args.steps, warmup=args.warmup,
              compare_before=args.compare_before, profile=False if args.no_profile else None)
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
