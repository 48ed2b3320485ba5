"""One dual-retriever training step on one device: plain torch against the project's DeepSpeed engine
(issue 23, item 4: "DeepSpeed on a GPU at the plain step's speed").

The model is the project's own :class:`~dist_nce.modeling.retriever.Retriever` (preset ``dual``: BLINK's
[CLS] inner product) with BERT-base on both sides, built from a config dict (random init, nothing is
downloaded), trained on :func:`dist_nce.modeling.losses.nce_loss` (gold in column 0) over B = 8 mentions
(32 tokens, the paper configs' ``mention_max_len``) x K = 64 candidates of 128 tokens, as
``dist_nce/train/loop.py`` does (every token real, so no column is trimmed). Modes, from the SAME initial
weights on the SAME batches, measured in the same process and interleaved (A B C A B C ...) after warm-up:

* ``plain``: fp32 master weights, ``torch.autocast(bf16)``, ``clip_grad_norm_(1.0)``, AdamW (``fused=True``
  on CUDA) with the engine's parameter groups and LambdaLR schedule;
* ``zero2`` / ``zero3``: :func:`dist_nce.worker.engine.build_engine` with configs/deepspeed/zero2_bf16.json /
  zero3_bf16.json through :func:`~dist_nce.worker.engine.load_deepspeed_config` at world size 1, as the
  trainer builds its engine (bf16 weights, fp32 master weights and AdamW state in the ZeRO optimizer,
  gradient clipping 1.0);
* ``compare_before`` (default off: the first H100 run measured it, 0.201 s and 0.365 s against 0.168 s
  plain; on for ``--compare-before yes``): a second group, its own ``plain`` as
  ``plain@before`` and ``zero2_before`` / ``zero3_before`` = the JSONs as issue 23 measured them
  (:data:`ISSUE_23_CONFIGS`, with the engine as it was: foreach AdamW, ``overlap_comm`` as written),
  so one run shows what the changes bought. Groups run one after the other (memory: one group's
  engines at a time).

Per mode: step seconds min / median / max (device synchronised before and after each step, nothing in
between), the median of each phase (forward = forward + loss, backward, optimizer step) as device time
between CUDA events recorded at the phase boundaries and as host time to issue the phase (host ~ device:
the GPU waits for the host), MFU (:data:`MFU_FORMULA`) against ``peak_tflops``, peak device memory (what
the mode holds + the most one of its steps allocates on top), the loss of every step, the largest
|loss - plain loss| over them and the ratio of its median step to its group's plain. ``profile`` (default
on CUDA): one more step per mode under torch.profiler, phase by phase: device kernels, host
synchronisations (stream/device/event syncs and ``.item()``), aten ops, the busiest host ops.
``targets``: issue 23's bars (ZeRO-2 <= 1.1x, ZeRO-3 <= 1.5x the plain step; losses within
:data:`LOSS_REL_TOL` of plain's first loss, the bf16 tolerance tests/benchmarks/test_gpu_train.py justifies).

``--lengths kb`` (issue 37 item 1): the candidates take the synthetic KILT KB's token lengths
(:mod:`benchmarks.kb_lengths`; mentions fill their 32 tokens, as AIDA's do), each batch cut to its longest
row, and every mode runs twice, padded and packed (``plain_packed``, ``zero2_packed``, ``zero3_packed``:
``RetrieverConfig.pack_tokens``, FlashAttention varlen through nested tensors on CUDA). MFU then counts the
real tokens only (:func:`real_token_flops`), and ``targets`` adds the issue's bars: the packed ZeRO-2 step
at >= 50% MFU, the packed ZeRO-3 step within 1.2x of it.

Where DeepSpeed's time goes and what changed: see :mod:`dist_nce.worker.engine`'s docstring (the JSONs'
``bf16.check_grad_overflow: false``, ``overlap_comm`` off at world size 1, ZeRO-3 ``leaf_module`` and
``memory_efficient_linear: false``, 2e8-element buckets, fused torch AdamW on CUDA; after the first H100 run: the
clipping norm in one ``_foreach_norm``, every ZeRO-3 parameter persistent at world size 1; after the second
(plain 0.152 s, ZeRO-2 1.03x, ZeRO-3 1.73x: optimizer phase 57 ms against ZeRO-2's 17): ZeRO-3's step no longer
releases and re-gathers parameters that are their own partition, no ZeRO-3 prefetch at world size 1).

Run (one GPU; prints the result as JSON; ``benchmarks/gpu.py --sections train`` runs it too)::

    python -m benchmarks.gpu_train --peak-tflops 770       # H100: the new group + profiles, ~40 s
    python -m benchmarks.gpu_train --compare-before yes     # also the issue-23 group: ~1.5 min
    .venv/bin/python -m benchmarks.gpu_train --quick --device cpu      # the test-sized form (~10 s)

Environment: DeepSpeed needs a torch.distributed process group; when none exists one is made for world
size 1 on loopback (``nccl`` on CUDA, ``gloo`` on CPU; RANK=0, LOCAL_RANK=0, WORLD_SIZE=1,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT unless already set). ``DS_ACCELERATOR`` is set to ``cuda``
or ``cpu`` to match ``device`` unless already set. Neither ray nor faiss is imported.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.gpu_common import bf16_peak, device_header, profiled, result_writer, sync

REPO = Path(__file__).resolve().parents[1]
DS_DIR = REPO / "configs" / "deepspeed"
DEFAULT_CONFIGS = {"zero2": str(DS_DIR / "zero2_bf16.json"), "zero3": str(DS_DIR / "zero3_bf16.json")}

# configs/deepspeed/zero{2,3}_bf16.json as issue 23 measured them (0.193 s and 0.376 s against 0.149 s plain);
# run with the engine of then: a foreach (not fused) AdamW and overlap_comm as written.
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

MFU_FORMULA = ("flops_per_step = sum over the two sides of 6 * matmul_params * tokens + 12 * layers * T^2 * d * "
               "sequences (matmul_params: weights of the encoder layers' Linear modules; tokens = sequences * T; "
               "the second term is attention's QK^T and AV, forward + backward; embeddings, the frozen pooler and "
               "the B x K scores are left out, < 0.1%); mfu = flops_per_step / median step seconds / "
               "(peak_tflops * 1e12)")

BERT_BASE = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TINY_BERT = {**BERT_BASE, "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 64}

# quick: one batch repeated at a 50x larger learning rate, so the weights move and the loss falls within the
# few steps a test can afford: equal losses then mean equal training, not just an equal forward.
FULL = {"mentions": 8, "candidates": 64, "mention_len": 32, "cand_len": 128, "warmup": 3, "steps": 15,
        "lr": 2e-5, "distinct_batches": True}
QUICK = {"mentions": 2, "candidates": 4, "mention_len": 8, "cand_len": 16, "warmup": 1, "steps": 3,
         "lr": 1e-3, "distinct_batches": False}

TARGETS = {"zero2": 1.1, "zero3": 1.5}  # issue 23: the engine's step time over the plain step's, at most
# issue 37 item 1, with realistic lengths: the packed ZeRO-2 step's MFU on real tokens, at least; ZeRO-3's step
# over ZeRO-2's, at most
PACKED_TARGETS = {"zero2_packed_mfu": 0.5, "zero3_over_zero2": 1.2}
LOSS_REL_TOL = 0.10  # of plain's first loss (the test's tolerance, justified in its docstring)

WEIGHT_DECAY, WARMUP_PROPORTION, GRAD_CLIP = 0.01, 0.1, 1.0  # BLINK's clip and warm-up; decay: both groups used


# --------------------------------------------------------------------------- model, batches, FLOPs


def packed_copy(model):
    """A copy of the retriever whose towers run packed (``RetrieverConfig.pack_tokens``: only the real tokens)."""
    model = copy.deepcopy(model)
    model.use_packing("auto")
    return model


def build_model(bert: dict[str, Any], seed: int):
    """The project's dual retriever with two randomly initialised transformers from ``bert`` (fp32, CPU)."""
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    torch.manual_seed(seed)
    return Retriever(RetrieverConfig(preset="dual"), Encoder.from_config(bert), Encoder.from_config(bert)).train()


def make_batches(n: int, shape: dict[str, Any], vocab: int, device: str, seed: int) -> list[tuple]:
    """``n`` batches (mention_ids [B, Lm], mention_mask, cand_ids [B, K, Lc], cand_mask, then the forward's
    keywords from :func:`host_checked` on the host masks, as the training step passes them), [CLS]=101 first
    as BLINK lays them out; one batch repeated unless ``shape["distinct_batches"]``. Every token is real, or
    with ``shape["lengths"] == "kb"`` each candidate's length is drawn from the synthetic KILT KB's
    (:mod:`benchmarks.kb_lengths`, scaled to ``cand_len``) and the batch is cut to its longest, as
    ``train.batches.trimmed`` cuts it; mentions fill their window (AIDA's do at 32)."""
    import numpy as np

    from benchmarks import kb_lengths
    from dist_nce.modeling.retriever import host_checked

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b, k, lm, lc = shape["mentions"], shape["candidates"], shape["mention_len"], shape["cand_len"]
    low = 1000 if vocab > 2000 else 2
    out = []
    for _ in range(n if shape.get("distinct_batches", True) else 1):
        m = torch.randint(low, vocab, (b, lm), generator=g)
        c = torch.randint(low, vocab, (b, k, lc), generator=g)
        m[:, 0] = c[..., 0] = min(101, vocab - 1)
        masks = torch.ones_like(m, dtype=torch.bool), torch.ones_like(c, dtype=torch.bool)
        if shape.get("lengths", "full") == "kb":
            lengths = torch.from_numpy(kb_lengths.sample(b * k, rng, lc)).reshape(b, k)
            width = int(lengths.max())
            cand_mask = torch.arange(width)[None, None, :] < lengths[..., None]
            c = c[..., :width] * cand_mask
            masks = masks[0], cand_mask
        out.append((*(t.to(device) for t in (m, masks[0], c, masks[1])), host_checked(*masks)))
    return out * (n // len(out))


def _matmul_params(encoder) -> int:
    """Weights of the encoder layers' Linear modules (:data:`MFU_FORMULA`'s matmul_params)."""
    return sum(m.weight.numel() for m in encoder.model.encoder.modules() if isinstance(m, torch.nn.Linear))


def real_token_flops(model, batch) -> int:
    """:data:`MFU_FORMULA` over the batch's real tokens only (padding is not work): per sequence of length
    l, 6 * matmul_params * l + 12 * layers * l^2 * d."""
    total = 0
    for enc, lengths in ((model.mention_encoder, batch[4]["mention_lengths"]),
                         (model.entity_encoder, batch[4]["cand_lengths"])):
        cfg = enc.model.config
        matmul = _matmul_params(enc)
        lengths = lengths.to(torch.int64)
        total += 6 * matmul * int(lengths.sum()) + 12 * cfg.num_hidden_layers * cfg.hidden_size * int(
            (lengths * lengths).sum())
    return total


def step_flops(model, shape: dict[str, Any]) -> dict[str, Any]:
    """Model FLOPs of one forward + backward (:data:`MFU_FORMULA`)."""
    total, parts = 0, {}
    for side, enc, seqs, t in (("mention", model.mention_encoder, shape["mentions"], shape["mention_len"]),
                               ("entity", model.entity_encoder, shape["mentions"] * shape["candidates"],
                                shape["cand_len"])):
        cfg = enc.model.config
        matmul = _matmul_params(enc)
        dense = 6 * matmul * seqs * t
        attention = 12 * cfg.num_hidden_layers * t * t * cfg.hidden_size * seqs
        parts[side] = {"matmul_params": matmul, "sequences": seqs, "tokens": seqs * t, "dense_flops": dense,
                       "attention_flops": attention}
        total += dense + attention
    return {"flops_per_step": total, "sides": parts, "formula": MFU_FORMULA}


# --------------------------------------------------------------------------- modes


def _original_linear():
    """torch's own ``F.linear``, also when a ZeRO-3 engine built earlier in this process replaced it
    (``memory_efficient_linear``, DeepSpeed's default, patches it process-wide)."""
    zp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    saved = getattr(getattr(zp, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    return saved or torch.nn.functional.linear


class Mode:
    """One way to train: ``forward(batch) -> loss``, ``backward(loss)``, ``step()``."""

    name: str
    linear: Callable | None = None

    def activate(self) -> None:
        """Each mode runs with the ``F.linear`` it would have alone in its process."""
        torch.nn.functional.linear = self.linear or _original_linear()

    def forward(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Plain(Mode):
    def __init__(self, name: str, model, device: str, lr: float, total_steps: int):
        from dist_nce.worker.engine import build_optimizer

        self.name = name
        self.device_type = device.split(":")[0]
        self.model = model.to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # build_engine's own AdamW (its parameter groups; fused on CUDA) and schedule, without DeepSpeed
        self.opt, self.sched = build_optimizer(self.model, lr, WEIGHT_DECAY, total_steps, WARMUP_PROPORTION)

    def forward(self, batch):
        from dist_nce.modeling.losses import nce_loss

        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            scores = self.model(*batch[:4], **batch[4])
        return nce_loss(scores.float())

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self):
        self.model = self.opt = self.sched = self.params = None


class Engine(Mode):
    """The trainer's path: ``build_engine`` + ``engine(...)``, ``engine.backward``, ``engine.step``."""

    def __init__(self, name: str, model, device: str, ds_config: dict, lr: float, total_steps: int,
                 before: bool = False):
        from dist_nce.worker.engine import build_engine

        self.name = name
        ours = torch.nn.functional.linear
        model = model.to(device)
        if before:  # the engine of issue 23: torch AdamW with its default (foreach) implementation
            self.engine, self.optimizer = _engine_as_before(model, ds_config, lr, total_steps)
        else:
            self.engine, self.optimizer, _ = build_engine(model, ds_config, lr=lr, weight_decay=WEIGHT_DECAY,
                                                          total_steps=total_steps,
                                                          warmup_proportion=WARMUP_PROPORTION,
                                                          dist_init_required=False)
        self.linear = torch.nn.functional.linear  # replaced by ZeRO-3 with memory_efficient_linear
        torch.nn.functional.linear = ours
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        self.info = {"deepspeed_optimizer": type(self.optimizer).__name__,
                     "torch_optimizer": type(inner).__name__,
                     "fused": bool(getattr(inner, "defaults", {}).get("fused")),
                     "zero_stage": int(self.engine.zero_optimization_stage()),
                     "bf16": bool(self.engine.bfloat16_enabled()),
                     "replaces_F_linear": self.linear is not ours}

    def forward(self, batch):
        from dist_nce.modeling.losses import nce_loss

        return nce_loss(self.engine(*batch[:4], **batch[4]).float())

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def close(self):
        try:
            self.engine.destroy()
        except Exception:  # noqa: BLE001 - best effort; the references go anyway
            pass
        self.engine = self.optimizer = None


def _engine_as_before(model, ds_config: dict, lr: float, total_steps: int):
    """build_engine as issue 23 ran it (before the fused AdamW): same groups, torch's default AdamW."""
    import deepspeed

    from dist_nce.cluster.runtime import pin_jit_builds
    from dist_nce.worker.engine import linear_warmup_decay

    pin_jit_builds()
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(total_steps, WARMUP_PROPORTION))
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config,
                                             dist_init_required=False)
    return engine, opt


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
        __import__("deepspeed")
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything at import
        return f"deepspeed cannot be imported: {type(e).__name__}: {e}"
    got = get_accelerator().device_name()
    if got != want:
        return f"deepspeed's accelerator is {got!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}), not {want!r}"
    return None


def _load_config(cfg: str | dict, micro_batch: int, engine_rules: bool) -> dict:
    """A DeepSpeed config as the trainer builds it (:func:`load_deepspeed_config`, world size 1); a dict goes
    through the same loader. ``engine_rules=False`` (the issue-23 group) keeps the JSON as written."""
    import tempfile

    from dist_nce.worker.engine import load_deepspeed_config

    if not engine_rules:
        cfg = copy.deepcopy(cfg if isinstance(cfg, dict) else json.loads(Path(cfg).read_text()))
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
        cfg["train_batch_size"] = micro_batch
        return cfg
    if isinstance(cfg, dict):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(cfg, f)
        try:
            return load_deepspeed_config(f.name, micro_batch=micro_batch, world_size=1, grad_clip=GRAD_CLIP)
        finally:
            os.unlink(f.name)
    return load_deepspeed_config(cfg, micro_batch=micro_batch, world_size=1, grad_clip=GRAD_CLIP)


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
    mode.activate()
    ph = _Phases(device)
    sync(device)
    t0 = time.perf_counter()
    ph.mark()
    loss = mode.forward(batch)
    ph.mark()
    mode.backward(loss)
    ph.mark()
    mode.step()
    ph.mark()
    sync(device)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "loss": float(loss.detach()), **ph.result()}


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _profile_step(mode: Mode, batch, device: str, top: int = 8) -> dict[str, Any]:
    """One step under torch.profiler, phase by phase: device kernels, host synchronisations (stream, device,
    event syncs; ``aten::_local_scalar_dense`` = ``.item()``/``bool()`` of a device value), aten ops, the
    busiest host-side ops (self time, ms), and the phase's host ms under the profiler."""
    from torch.autograd import DeviceType

    mode.activate()
    out: dict[str, Any] = {}
    held: dict[str, Any] = {}  # the forward's loss for the backward, and each phase's host ms

    def run(phase: str) -> None:
        t0 = time.perf_counter()
        if phase == "forward":
            held["loss"] = mode.forward(batch)
        elif phase == "backward":
            mode.backward(held["loss"])
        else:
            mode.step()
        held["ms"] = 1e3 * (time.perf_counter() - t0)

    for phase in ("forward", "backward", "optimizer"):
        sync(device)
        prof = profiled(lambda: run(phase), device)  # its closing sync is inside the trace: not counted below
        ms = held["ms"]
        events = list(prof.events())
        host = [e for e in events if e.device_type == DeviceType.CPU]
        syncs: dict[str, int] = {}
        for e in host:
            if e.name in SYNC_OPS:
                syncs[e.name] = syncs.get(e.name, 0) + 1
        if device.startswith("cuda") and syncs.get("cudaDeviceSynchronize"):
            syncs["cudaDeviceSynchronize"] -= 1
        ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        out[phase] = {"profiled_host_ms": round(ms, 3),
                      "device_kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
                      "host_syncs": syncs, "aten_ops": sum(1 for e in host if e.name.startswith("aten::")),
                      "top_host_ops": [[e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in ranked]}
    return out


# --------------------------------------------------------------------------- the run


def _run_group(modes: dict[str, Mode], batches: list, rounds: int, warmup: int, device: str, resident: dict,
               entries: dict, log: Callable[[str], None]) -> dict[str, list[dict]]:
    """Interleaved rounds over ``modes``; a mode that fails is closed, recorded and dropped."""
    is_cuda = device.startswith("cuda")
    records: dict[str, list[dict]] = {name: [] for name in modes}
    peaks = {name: 0 for name in modes}
    for rnd in range(rounds):
        for name in list(modes):
            mode = modes[name]
            try:
                before = torch.cuda.memory_allocated() if is_cuda else 0
                if is_cuda:
                    torch.cuda.reset_peak_memory_stats()
                rec = _one_step(mode, batches[rnd], device)
                if is_cuda:
                    peaks[name] = max(peaks[name], resident[name] + torch.cuda.max_memory_allocated() - before)
                    resident[name] += torch.cuda.memory_allocated() - before
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: drop this mode, keep the others
                entries[name]["error"] = f"step {rnd}: {type(e).__name__}: {e}"
                entries[name]["traceback"] = traceback.format_exc()[-3000:]
                log(f"{name}: dropped at step {rnd}: {type(e).__name__}: {e}")
                mode.close()
                del modes[name]
                if is_cuda:
                    torch.cuda.empty_cache()
                continue
            rec["timed"] = rnd >= warmup
            records[name].append(rec)
        if rnd in (0, rounds - 1):
            log(f"round {rnd}: " + ", ".join(f"{n} {records[n][-1]['seconds']:.3f} s loss {records[n][-1]['loss']:.4f}"
                                             for n in modes if records[n]))
    for name in records:
        entries[name]["peak_memory_bytes"] = peaks[name] if is_cuda else None
        entries[name]["peak_memory_gib"] = round(peaks[name] / 2 ** 30, 3) if is_cuda else None
        entries[name]["resident_memory_gib"] = round(resident[name] / 2 ** 30, 3) if is_cuda else None
    return records


def _summarise(records: dict[str, list[dict]], entries: dict, plain: str, flops: int, peak_tflops: float) -> None:
    plain_losses = [r["loss"] for r in records.get(plain, [])]
    for name, recs in records.items():
        e = entries[name]
        e["losses"] = [r["loss"] for r in recs]
        if name != plain and plain_losses and recs:
            diffs = [abs(a - b) for a, b in zip(e["losses"], plain_losses)]
            e["max_abs_loss_diff_vs_plain"] = max(diffs)
            e["first_step_abs_loss_diff_vs_plain"] = diffs[0]
            e["max_loss_diff_over_initial_loss"] = max(diffs) / abs(plain_losses[0])
        timed = [r for r in recs if r["timed"]]
        if not timed:
            continue
        e["step_seconds"] = _spread([r["seconds"] for r in timed])
        e["tflops_per_s"] = flops / e["step_seconds"]["median"] / 1e12
        e["mfu"] = e["tflops_per_s"] / peak_tflops
        e["phases_median_ms"] = {kind: {ph: statistics.median(r[kind][ph] for r in timed)
                                        for ph in ("forward", "backward", "optimizer")}
                                 for kind in ("host_ms", "device_ms") if kind in timed[0]}
    base = entries.get(plain, {}).get("step_seconds")
    for name in records:
        s = entries[name].get("step_seconds")
        if base and s:
            entries[name]["ratio_to_plain"] = s["median"] / base["median"]
            entries[name]["ratio_to_plain_range"] = [s["min"] / base["max"], s["max"] / base["min"]]


def run(device: str = "cuda", quick: bool = False, peak_tflops: float | None = None, *,
        steps: int | None = None, warmup: int | None = None, configs: dict[str, Any] | None = None,
        compare_before: bool = False, profile: bool | None = None, seed: int = 0,
        log: Callable[[str], None] | None = None, bert: dict[str, Any] | None = None,
        lengths: str = "full", packed: bool | None = None,
        partial: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Measure plain torch vs the project's DeepSpeed engine on ``device`` (see the module docstring).

    ``lengths``: ``full`` (every token real) or ``kb`` (candidates of the synthetic KILT KB's lengths,
    :func:`make_batches`); ``packed`` (default: with ``kb``) adds ``plain_packed`` / ``zero2_packed`` /
    ``zero3_packed``, the same modes with the towers packed (``RetrieverConfig.pack_tokens``). MFU counts the
    real tokens only (:func:`real_token_flops`, the mean over the timed batches).

    ``quick``: a tiny BERT (2 layers, hidden 64), a small batch repeated, 1 + 3 steps: the CPU test.
    ``steps`` / ``warmup``: timed / untimed interleaved rounds (default 15 / 3). ``configs``: name -> DeepSpeed
    JSON path or dict (default :data:`DEFAULT_CONFIGS`). ``compare_before`` (default off: already measured)
    adds the group of :data:`ISSUE_23_CONFIGS`. ``profile`` (default: on CUDA) runs one more, profiled step
    per mode. ``peak_tflops``: the device's bf16 peak measured by the caller, else measured here. A mode that
    fails (out of memory, a DeepSpeed error) is recorded with its error and the others go on. ``partial``
    (:func:`benchmarks.gpu_common.result_writer`) gets the result so far once a group's timings are
    summarised and after each mode's profile.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    shape = dict(QUICK if quick else FULL)
    if lengths not in ("full", "kb"):
        raise ValueError(f"lengths must be full or kb, got {lengths!r}")
    shape["lengths"] = lengths
    packed = lengths == "kb" if packed is None else packed
    shape["steps"] = steps if steps is not None else shape["steps"]
    shape["warmup"] = warmup if warmup is not None else shape["warmup"]
    bert = bert or (TINY_BERT if quick else BERT_BASE)  # bert: a config dict (gpu_e2e: the job's model)
    is_cuda = device.startswith("cuda")
    profile = is_cuda if profile is None else profile
    compare_before = bool(compare_before)
    rounds = shape["warmup"] + shape["steps"]
    linear0 = _original_linear()

    result: dict[str, Any] = {
        "benchmark": "gpu_train (issue 23 item 4)", "device": device, "quick": quick, **device_header(device),
        "model": {"retriever": "dual", "bert": bert},
        "batch": {k: shape[k] for k in ("mentions", "candidates", "mention_len", "cand_len", "distinct_batches",
                                        "lengths")},
        "rounds": {"warmup": shape["warmup"], "timed": shape["steps"], "order": "interleaved A B C A B C ..."},
        "optim": {"lr": shape["lr"], "weight_decay": WEIGHT_DECAY, "warmup_proportion": WARMUP_PROPORTION,
                  "grad_clip": GRAD_CLIP, "schedule": f"linear warm-up + decay over {rounds} steps"},
        "modes": {},
    }
    size, repeats = (8192, 20) if is_cuda else (256, 3)
    result["peak_tflops"], result["peak_source"] = bf16_peak(peak_tflops, device, size, repeats)

    base = build_model(bert, seed).to(device)  # the modes' copies are then device-to-device
    flops = step_flops(base, shape)
    batches = make_batches(rounds + 1, shape, bert["vocab_size"], device, seed + 1)
    if lengths == "kb":  # the work is the real tokens': the mean over the timed batches
        real = [real_token_flops(base, b) for b in batches[shape["warmup"]:rounds]]
        tokens = [int(b[4]["cand_lengths"].sum()) for b in batches[shape["warmup"]:rounds]]
        widths = [int(b[2].shape[-1]) for b in batches[shape["warmup"]:rounds]]
        flops = {**flops, "flops_per_step": round(statistics.mean(real)),
                 "full_length_flops_per_step": flops["flops_per_step"],
                 "real_candidate_tokens_mean": statistics.mean(tokens),
                 "candidate_width_mean": statistics.mean(widths),
                 "formula": MFU_FORMULA + "; with lengths=kb over the real tokens only (real_token_flops): "
                            "full_length_flops_per_step is the shape's with every token real"}
    result["flops"] = flops

    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env0 = {k: os.environ.get(k) for k in dist_env}
    skip = _import_deepspeed(device)
    if skip is None:
        try:
            result["process_group"] = _ensure_process_group(device)
            result["versions"]["deepspeed"] = __import__("deepspeed").__version__
        except Exception as e:  # noqa: BLE001
            skip = f"no process group for DeepSpeed: {type(e).__name__}: {e}"
    groups = [("plain", dict(DEFAULT_CONFIGS if configs is None else configs), True)]
    if compare_before:
        groups.append(("plain@before", dict(ISSUE_23_CONFIGS), False))
    entries: dict[str, dict[str, Any]] = result["modes"]
    save = partial or (lambda r: None)
    alloc = torch.cuda.memory_allocated if is_cuda else (lambda: 0)
    try:
        for plain_name, wanted, now in groups:
            modes: dict[str, Mode] = {}
            resident: dict[str, int] = {}
            a0 = alloc()
            modes[plain_name] = Plain(plain_name, copy.deepcopy(base), device, shape["lr"], rounds)
            resident[plain_name] = alloc() - a0
            entries[plain_name] = {"kind": "plain torch: fp32 weights, bf16 autocast, clip_grad_norm_, AdamW"
                                           + (" fused" if is_cuda else "")}
            if packed and now:
                a0 = alloc()
                modes["plain_packed"] = Plain("plain_packed", packed_copy(base), device, shape["lr"], rounds)
                resident["plain_packed"] = alloc() - a0
                entries["plain_packed"] = {"kind": entries[plain_name]["kind"] + "; towers packed"}
            variants = [(n, c, False) for n, c in wanted.items()]
            if packed and now:
                variants += [(f"{n}_packed", c, True) for n, c in wanted.items()]
            for name, cfg, pack in variants:
                if skip is not None:
                    entries[name] = {"skipped": skip}
                    continue
                try:
                    ds = _load_config(cfg, shape["mentions"], engine_rules=now)
                    a0 = alloc()
                    model = packed_copy(base) if pack else copy.deepcopy(base)
                    mode = Engine(name, model, device, ds, shape["lr"], rounds, before=not now)
                    modes[name] = mode
                    resident[name] = alloc() - a0
                    entries[name] = {"kind": ("dist_nce.worker.engine.build_engine" if now else
                                              "the engine and JSON of issue 23") + ("; towers packed" if pack else ""),
                                     **mode.info,
                                     "config": cfg if isinstance(cfg, str) else "inline", "ds_config": ds}
                except Exception as e:  # noqa: BLE001
                    entries[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                    log(f"{name}: engine not built: {type(e).__name__}: {e}")
            log(f"group {plain_name}: modes {list(modes)} built at {time.perf_counter() - t_start:.1f} s")
            records = _run_group(modes, batches, rounds, shape["warmup"], device, resident, entries, log)
            _summarise(records, entries, plain_name, flops["flops_per_step"], result["peak_tflops"])
            save(result)
            if profile:
                for name, mode in modes.items():
                    try:
                        entries[name]["profile"] = _profile_step(mode, batches[rounds], device)
                    except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
                        entries[name]["profile"] = {"error": f"{type(e).__name__}: {e}"}
                    save(result)
            for mode in modes.values():
                mode.close()
            modes.clear()
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
                entries[plain_name]["allocated_after_group_gib"] = round(alloc() / 2 ** 30, 3)
    finally:
        torch.nn.functional.linear = linear0
        for k, v in env0.items():  # the process group stays; the variables set for it go
            if v is None:
                os.environ.pop(k, None)
    del base
    result["targets"] = {}
    for name, limit in TARGETS.items():
        if name in entries:
            ratio, gap = entries[name].get("ratio_to_plain"), entries[name].get("max_loss_diff_over_initial_loss")
            result["targets"][name] = {"max_ratio_to_plain": limit, "ratio_to_plain": ratio,
                                       "met": ratio is not None and ratio <= limit,
                                       "max_loss_diff_over_initial_loss": gap,
                                       "losses_within_bf16_tolerance": gap is not None and gap <= LOSS_REL_TOL}
    if "zero2_packed" in entries:
        z2, z3 = entries["zero2_packed"], entries.get("zero3_packed", {})
        ratio = (z3["step_seconds"]["median"] / z2["step_seconds"]["median"]
                 if "step_seconds" in z3 and "step_seconds" in z2 else None)
        result["targets"]["zero2_packed_mfu"] = {"min": PACKED_TARGETS["zero2_packed_mfu"], "mfu": z2.get("mfu"),
                                                 "met": (z2.get("mfu") or 0) >= PACKED_TARGETS["zero2_packed_mfu"]}
        result["targets"]["zero3_packed_over_zero2_packed"] = {
            "max": PACKED_TARGETS["zero3_over_zero2"], "ratio": ratio,
            "met": ratio is not None and ratio <= PACKED_TARGETS["zero3_over_zero2"]}
    result["loss_tolerance"] = (f"max |loss - plain loss| over the steps <= {LOSS_REL_TOL:g} x plain's first loss: "
                                "pure bf16 (engine) vs fp32 elementwise ops under autocast (plain) on the same bf16 "
                                "weights; see tests/benchmarks/test_gpu_train.py")
    result["memory_note"] = ("peak_memory: what the mode holds (weights, optimizer state, buffers: every "
                             "allocation it made since it was built) + the most one of its steps allocated on "
                             "top; other modes' memory not counted" if is_cuda else "no device memory on CPU")
    result["seconds"] = time.perf_counter() - t_start
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny BERT, small batch, 1 + 3 steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: measure a bf16 matmul)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--compare-before", choices=["yes", "no"], default="no",
                    help="also the configs issue 23 measured (default no: the first H100 run has them)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--lengths", choices=["full", "kb"], default="full",
                    help="kb: candidates of the synthetic KILT KB's token lengths, packed modes added (issue 37)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    res = run(args.device, args.quick, args.peak_tflops, steps=args.steps, warmup=args.warmup,
              compare_before=args.compare_before == "yes",
              profile=False if args.no_profile else None, lengths=args.lengths, partial=result_writer(args.out))
    text = json.dumps({**res, "complete": True}, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
