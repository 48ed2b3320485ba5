"""Entity encoding on one device through the shard's own encode path (issue 23, item 3: a refresh on a GPU
at >= 60% of the measured bf16 peak, BERT-large, T = 128).

The encoder is the project's :class:`~dist_nce.modeling.retriever.EntityEncoder` (preset ``dual``: the [CLS]
state) over BERT-large built from a config dict (hidden 1024, 24 layers, 16 heads, intermediate 4096, vocab
30522; random init, nothing is downloaded), readied by :func:`dist_nce.index.encode.prepare_encoder` (what a
shard does: device, weights dtype, ``choose_attention``, ``compile_encoder``) and timed through
:func:`dist_nce.index.encode.encode_rows` itself (length-sorted batches, scatter back, reps copied to the
host in fp32 every batch) over rows of T = 128 real tokens each (KILT pages nearly all fill the 128
tokens), held by :class:`FullRows`, an in-memory stand-in for the ``EntityStore`` (``encode_rows`` reads
only ``num_entities``, ``max_len``, ``lengths`` and ``token_ids``), so no Arrow store is built.

Variants (``ServiceConfig`` settings in brackets), timed interleaved (A B C A B C ...) after warm-up. By default
(:data:`DEFAULT_VARIANTS`, ~1 min on an H100):

* ``c_eager_bf16w``: weights held in bf16, the whole forward in bf16, no autocast [encode_weights bf16, which
  ``auto`` is on CUDA; encode_compile false] -- the reference;
* ``c_eager_bf16w_batch2x``: the same at twice the batch (1024);
* ``e_compiled_layers_bf16w``: (c) with each transformer layer compiled, ``dynamic=False``, the attention
  mask built eagerly (``compile_encoder(layers=True)``, what ``encode_compile: auto`` or ``true`` does on
  CUDA): the compiled variant that keeps the fused attention kernel (see ``compile_encoder``) -- the CUDA
  shard default since it measured fastest (66.5% against 61.3% for (c), benchmarks/results/gpu_encode.json).

Measured already (H100, torch 2.11, transformers 5.17, batch 512, 733 TFLOP/s peak; rerun by name with
``variants``): ``a_eager_fp32w_autocast`` (fp32 weights, bf16 autocast: 4460/s, 48.0%),
``b_compiled_fp32w_autocast`` (that, the whole model compiled: 3409/s, 36.7%), ``c_eager_bf16w`` (5445/s,
58.6%) and ``d_compiled_bf16w`` ((c), the whole model compiled: 3628/s, 39.0%; its graph built the all-True
mask and ran the math attention with fp32 GEMMs).

On CUDA ``encode_rows`` gives a batch without padding no attention mask (``encode_batch``), so sdpa may
run a flash kernel; each variant's attention backend is read off a profiled batch (the aten sdpa op and the
CUDA kernel names), and ``sdpa_probe`` times the attention alone per backend (flash without a mask,
memory-efficient and cuDNN with/without an all-True mask) at the timed shape, 24 layers' worth.

Reported per variant: entities/s (min / median / max over the timed rounds), MFU against ``peak_tflops``
(:data:`FLOP_FORMULA`), the minutes a 5,903,530-row KILT refresh takes on 8 such GPUs at that rate, the time
of the first call (for compiled variants: the compile, paid once per shard process), the attention backend
and the busiest kernels. ``numerics``: the reps of every variant against an fp32 encode of the same rows
(relative L2 error per row, min cosine), and whether bf16 weights stay within bf16 tolerance of autocast.

    .venv/bin/python -m benchmarks.gpu_encode                   # BERT-large on cuda; ~1-1.5 min on an H100
    .venv/bin/python -m benchmarks.gpu_encode --quick --device cpu   # tiny sizes (tests/benchmarks)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from benchmarks.common import interleaved
from benchmarks.gpu_common import bf16_peak, device_header, profiled, result_writer, sync, timed
from dist_nce.index.encode import compile_wanted, encode_precision, encode_rows, prepare_encoder
from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import EntityEncoder
from dist_nce.modeling.scoring import ScoreSpec

BERT_LARGE = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
              "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512}
TINY_BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 256, "vocab_size": 1000, "max_position_embeddings": 64}
# every call of a compiled encoder uses the timed batch shape (numerics and profile included): no recompiles
FULL = {"T": 128, "batch": 512, "batches": 8, "warmup": 1, "repeats": 7}
QUICK = {"T": 32, "batch": 16, "batches": 2, "warmup": 1, "repeats": 2}
# name -> (encode_dtype, encode_weights, compile, batch multiple, description): the ServiceConfig settings of
# each variant; compile: None (eager), "model" (the whole model, dynamic) or "layers" (compile_encoder)
VARIANTS = {
    "a_eager_fp32w_autocast": ("bf16", "fp32", None, 1, "fp32 weights, bf16 autocast, eager (the old default)"),
    "b_compiled_fp32w_autocast": ("bf16", "fp32", "model", 1, "fp32 weights, bf16 autocast, whole model compiled"),
    "c_eager_bf16w": ("bf16", "bf16", None, 1, "bf16 weights, no autocast, eager"),
    "c_eager_bf16w_batch2x": ("bf16", "bf16", None, 2, "bf16 weights, no autocast, eager, twice the batch"),
    "d_compiled_bf16w": ("bf16", "bf16", "model", 1, "bf16 weights, no autocast, whole model compiled"),
    "e_compiled_layers_bf16w": ("bf16", "bf16", "layers", 1,
                                "bf16 weights, no autocast, each layer compiled (dynamic=False), mask eager "
                                "(the CUDA default)"),
    "f_packed_bf16w": ("bf16", "bf16", None, 1, "bf16 weights, no autocast, eager, packed: only the real "
                       "tokens, attention by row offsets (service.encode_pack; issue 37 item 2)"),
}
PACKED_VARIANTS = ("f_packed_bf16w",)
DEFAULT_VARIANTS = ("c_eager_bf16w", "c_eager_bf16w_batch2x", "e_compiled_layers_bf16w")
# lengths=kb (issue 37 item 2): the CUDA default against the same eager and packed
KB_VARIANTS = ("c_eager_bf16w", "e_compiled_layers_bf16w", "f_packed_bf16w")
MEASURED = ("a_eager_fp32w_autocast, b_compiled_fp32w_autocast, c_eager_bf16w at batch 512 and d_compiled_bf16w "
            "were measured on an H100 (torch 2.11, transformers 5.17): 48.0%, 36.7%, 58.6%, 39.0% of 733 TFLOP/s")
KILT_ROWS = 5_903_530
GPUS = 8
FLOP_FORMULA = ("per entity: 2 x (matmul weights of the transformer layers: L x (4 d^2 + 2 d d_ff)) x T "
                "+ attention QK^T and AV: 4 x T^2 x d per layer; embeddings, biases, layer norms and the "
                "pooler left out")
TOLERANCE = ("bf16 weights agree when every row's relative L2 error, against the fp32 encode and against autocast, "
             "is at most 1.5 x 2^-8 x sqrt(2 L + 1): bf16 keeps 8 significant bits (unit roundoff 2^-8), and the "
             "residual stream is rounded to bf16 after the embeddings and after each of the 2 L sub-layers, "
             "roundings that add in quadrature (0.013 for L = 2, 0.041 for L = 24)")


def bf16_tolerance(layers: int) -> float:
    """:data:`TOLERANCE` for a transformer of ``layers`` layers."""
    return 1.5 * 2.0 ** -8 * (2 * layers + 1) ** 0.5


class FullRows:
    """An in-memory stand-in for ``kb.store.EntityStore``: ``n`` rows of ``T`` real tokens each
    ([CLS] ... [SEP], random ids between), with what ``encode_rows`` reads."""

    def __init__(self, n: int, T: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        low = 1000 if vocab > 2000 else 3  # past BERT's [unused] / special ids
        self.ids = rng.integers(low, vocab, size=(n, T), dtype=np.int32)
        self.ids[:, 0], self.ids[:, -1] = (101, 102) if vocab > 2000 else (1, 2)
        self.max_len = T

    @property
    def num_entities(self) -> int:
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return self.num_entities

    def lengths(self, rows: Any) -> np.ndarray:
        return np.full(len(np.asarray(rows)), self.max_len, dtype=np.int32)

    def token_ids(self, rows: Any) -> np.ndarray:
        return self.ids[np.asarray(rows, dtype=np.int64)]

    def head(self, n: int) -> "FullRows":
        out = copy.copy(self)
        out.ids = self.ids[:n]
        return out


class KBRows(FullRows):
    """:class:`FullRows` whose rows have the synthetic KILT KB's token lengths (:mod:`benchmarks.kb_lengths`,
    scaled to ``T``): real tokens first, [SEP] last, zeros after."""

    def __init__(self, n: int, T: int, vocab: int, seed: int = 0):
        from benchmarks import kb_lengths

        super().__init__(n, T, vocab, seed)
        self._lengths = kb_lengths.sample(n, np.random.default_rng(seed + 1), T).astype(np.int32)
        for i, n_real in enumerate(self._lengths):
            self.ids[i, n_real - 1] = 102 if vocab > 2000 else 2
            self.ids[i, n_real:] = 0

    def lengths(self, rows: Any) -> np.ndarray:
        return self._lengths[np.asarray(rows, dtype=np.int64)]

    def head(self, n: int) -> "KBRows":
        out = super().head(n)
        out._lengths = self._lengths[:n]
        return out


def real_flops_per_entity(cfg: dict[str, Any], lengths: np.ndarray) -> dict[str, Any]:
    """:data:`FLOP_FORMULA` over each row's real tokens (padding is not work), the mean over the rows."""
    t = lengths.astype(np.float64)
    rows = flops_per_entity(cfg, t)  # per row
    return {**rows, **{k: float(rows[k].mean()) for k in ("per_entity", "matmul", "attention")},
            "real_tokens_mean": float(t.mean()),
            "formula": FLOP_FORMULA + "; each row at its own real length, the mean over the rows"}


def flops_per_entity(cfg: dict[str, Any], T: Any) -> dict[str, Any]:
    """:data:`FLOP_FORMULA` for a BERT config dict; ``T`` a length, or an array of them (per row)."""
    d, L, ff = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    params = L * (4 * d * d + 2 * d * ff)
    matmul, attention = 2.0 * params * T, 4.0 * T * T * d * L
    return {"per_entity": matmul + attention, "matmul": matmul, "attention": attention, "matmul_params": params,
            "formula": FLOP_FORMULA}


def _attention_profile(fn: Callable[[], Any], device: torch.device, top: int = 8) -> dict[str, Any]:
    """Which sdpa backend ``fn`` ran (aten ops and CUDA kernels whose names say attention) and the
    busiest device kernels (share of device time), from one profiled call."""
    ops, kernels, times = set(), set(), {}
    for e in profiled(fn, device).events():
        name = e.name
        low = name.lower()
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0)
            times[name] = times.get(name, 0.0) + t
            if any(k in low for k in ("flash", "fmha", "attention", "cudnn", "sdpa")):
                kernels.add(name[:120])
        elif name.startswith("aten::") and ("attention" in low or "scaled_dot_product" in low):
            ops.add(name)
    if any("flash" in o for o in ops) or any("flash" in k.lower() for k in kernels):
        backend = "flash"
    elif any("cudnn" in o for o in ops):
        backend = "cudnn"
    elif any("efficient" in o for o in ops) or any("fmha" in k.lower() or "efficient" in k.lower() for k in kernels):
        backend = "memory-efficient"
    elif ops:
        backend = "math"
    else:
        backend = "unknown"
    if device.type == "cpu" and "for_cpu" in " ".join(ops):
        backend = "cpu flash"
    total = sum(times.values()) or 1.0
    busiest = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    attn = sum(t for n, t in times.items() if any(k in n.lower() for k in ("flash", "fmha", "attention", "cudnn")))
    return {"backend": backend, "aten_ops": sorted(ops), "kernels": sorted(kernels)[:8],
            "attention_share": attn / total if times else None,
            "busiest_kernels": [{"name": n[:100], "share": round(t / total, 4)} for n, t in busiest]}


def sdpa_probe(device: torch.device, batch: int, T: int, heads: int, head_dim: int, layers: int,
               repeats: int = 5) -> dict[str, Any]:
    """Attention alone at the encode's shape, ``layers`` calls per forward: ms per forward for each sdpa
    backend, without a mask and with an all-True boolean mask [B, 1, T, T] (as transformers builds it)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16
    q, k, v = (torch.randn(batch, heads, T, head_dim, device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(batch, 1, T, T, device=device, dtype=torch.bool)
    backends = {"default": None}
    if device.type == "cuda":
        backends.update(flash=SDPBackend.FLASH_ATTENTION, efficient=SDPBackend.EFFICIENT_ATTENTION,
                        cudnn=SDPBackend.CUDNN_ATTENTION, math=SDPBackend.MATH)
    out: dict[str, Any] = {"shape": [batch, heads, T, head_dim], "layers": layers, "ms_per_forward": {}}
    flops = 4.0 * T * T * heads * head_dim * batch * layers
    for name, backend in backends.items():
        for masked in (False, True):
            key = f"{name}{'_masked' if masked else ''}"
            try:
                ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
                with ctx, torch.inference_mode():
                    bias = mask if masked else None

                    def run(bias=bias):
                        return [F.scaled_dot_product_attention(q, k, v, attn_mask=bias) for _ in range(layers)]
                    best = timed(run, device, repeats)["min"]
                out["ms_per_forward"][key] = {"ms": best * 1e3, "tflops": flops / best / 1e12}
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape or the mask
                out["ms_per_forward"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return out


def _timed(methods: dict[str, Callable[[], Any]], repeats: int, warmup: int, entries: dict[str, dict],
           log: Callable[[str], None]) -> dict[str, dict]:
    """:func:`benchmarks.common.interleaved`; if a method fails there (an out-of-memory), each method
    alone, the failing ones recorded with their error."""
    try:
        return interleaved(methods, repeats, warmup)
    except Exception as e:  # noqa: BLE001
        log(f"gpu_encode: interleaved timing failed ({type(e).__name__}: {e}); timing each variant alone")
    out = {}
    for name, fn in methods.items():
        try:
            out[name] = interleaved({name: fn}, repeats, warmup)[name]
        except Exception as e:  # noqa: BLE001
            entries[name]["error"] = f"timing: {type(e).__name__}: {e}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _rates(seconds: dict[str, Any], rows: int, flops: float, peak: float) -> dict[str, Any]:
    rate = {"min": rows / seconds["max"], "median": rows / seconds["median"], "max": rows / seconds["min"]}
    mfu = {k: v * flops / (peak * 1e12) for k, v in rate.items()}
    refresh = {k: KILT_ROWS / (GPUS * v) / 60 for k, v in rate.items()}
    return {"entities_per_s": rate, "mfu": mfu, "refresh_kilt_8gpu_min": refresh}


def run(device: str = "cuda", quick: bool = False, peak_tflops: float | None = None, *,
        compile: bool = True, variants: Sequence[str] | None = None,
        repeats: int | None = None, seed: int = 0, log: Callable[[str], None] | None = None,
        lengths: str = "full", partial: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Measure the encode variants of the module docstring on ``device``; returns a JSON-able dict.

    ``quick``: a tiny BERT (2 layers, hidden 64), T = 32, batch 16, for CPU tests. ``peak_tflops``: the
    bf16 GEMM peak measured by the caller in the same run (else measured here, 8192^3). ``variants``: some
    of :data:`VARIANTS` by name (default :data:`DEFAULT_VARIANTS`); ``compile=False`` drops the compiled
    ones. A variant that fails (an out-of-memory, a compile error) is recorded with its error and the
    others go on. ``lengths``: ``full`` (every row T real tokens) or ``kb`` (:class:`KBRows`; default variants
    :data:`KB_VARIANTS`; MFU over the real tokens; each variant's first pass over all the rows, compiles
    included, beside the warm rounds). ``partial`` (:func:`benchmarks.gpu_common.result_writer`) gets the
    result so far after each variant is ready (its first pass), after the numerics and after the timed rounds.
    """
    if lengths not in ("full", "kb"):
        raise ValueError(f"lengths must be full or kb, got {lengths!r}")
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; expected some of {list(VARIANTS)}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    dev = torch.device(device)
    shape = dict(QUICK if quick else FULL)
    if repeats is not None:
        shape["repeats"] = int(repeats)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32 (restored at the end)
    try:
        chosen = tuple(variants or (KB_VARIANTS if lengths == "kb" else DEFAULT_VARIANTS))
        return _run(dev, quick, peak_tflops, compile, chosen, shape, seed, log, lengths, partial or (lambda r: None))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(dev: torch.device, quick: bool, peak_tflops: float | None, compile: bool, variants: tuple[str, ...],
         shape: dict[str, int], seed: int, log: Callable[[str], None], lengths: str = "full",
         partial: Callable[[dict], None] = lambda r: None) -> dict[str, Any]:
    t_start = time.perf_counter()
    cfg = TINY_BERT if quick else BERT_LARGE
    T, B = shape["T"], shape["batch"]
    rows = B * shape["batches"]
    store = (KBRows if lengths == "kb" else FullRows)(rows, T, cfg["vocab_size"], seed)
    flops = flops_per_entity(cfg, T) if lengths == "full" else \
        real_flops_per_entity(cfg, store.lengths(np.arange(rows)))
    is_cuda = dev.type == "cuda"
    result: dict[str, Any] = {
        "benchmark": "gpu_encode (issue 23 item 3)", "device": str(dev), "quick": quick, **device_header(dev),
        "model": {"bert": cfg, "spec": "dual", "T": T, "init": "random (seeded)"},
        "rows": {"per_timing": rows, "batch": B, "all_full_length": lengths == "full", "lengths": lengths,
                 "store": f"{type(store).__name__} (in memory)"},
        "rounds": {"warmup": shape["warmup"], "timed": shape["repeats"], "order": "interleaved A B C A B C ..."},
        "flops": flops, "tolerance": TOLERANCE, "variants": {}, "skipped": [],
    }
    if is_cuda:
        result["sdp_flags"] = {name: bool(getattr(torch.backends.cuda, f"{name}_sdp_enabled")())
                               for name in ("flash", "mem_efficient", "cudnn", "math")}
    result["peak_tflops"], result["peak_source"] = bf16_peak(peak_tflops, dev, 8192 if is_cuda and not quick else 256)
    peak = result["peak_tflops"]

    torch.manual_seed(seed)
    base = EntityEncoder(Encoder.from_config(cfg), ScoreSpec.preset("dual")).eval()
    linear = sum(m.weight.numel() for m in base.encoder.model.encoder.modules() if isinstance(m, torch.nn.Linear))
    assert linear == flops["matmul_params"], (linear, flops["matmul_params"])
    log(f"gpu_encode: model built ({time.perf_counter() - t_start:.1f} s); {rows} rows of T={T} per timing")

    specs = {k: VARIANTS[k] for k in variants}
    if not compile:
        specs = {k: v for k, v in specs.items() if not v[2]}
        result["skipped"].append("compiled variants (compile=False)")
    if set(specs) != set(VARIANTS):
        result["skipped"].append(f"not run: {', '.join(k for k in VARIANTS if k not in specs)} ({MEASURED})")
    default = (encode_precision("auto", "auto", dev), compile_wanted("auto", dev))
    encoders: dict[str, EntityEncoder] = {}
    batch = {name: B * spec[3] for name, spec in specs.items()}
    entries: dict[str, dict[str, Any]] = result["variants"]

    def encode(enc: EntityEncoder, autocast, data, size: int = B):
        out = encode_rows(enc, data, size, dev, autocast, "float32")
        sync(dev)
        return out

    for name, (dtype, weights, compiled, _, what) in specs.items():
        precision = encode_precision(dtype, weights, dev)
        entry = entries[name] = {"description": what, "encode_dtype": dtype, "encode_weights": weights,
                                 "weights": str(precision.weights).removeprefix("torch."),
                                 "autocast": None if precision.autocast is None else str(precision.autocast)
                                 .removeprefix("torch."), "compile": compiled is not None,
                                 "compile_scope": compiled, "batch": batch[name],
                                 "shard_default": (precision, compiled is not None) == default
                                 and batch[name] == B}
        try:
            enc = copy.deepcopy(base)
            # the shard's prepare_encoder; the compile scope named (CUDA shards compile the layers)
            entry["attention"] = prepare_encoder(enc, precision, "auto", compiled is not None, dev,
                                                 layers=compiled == "layers", pack=name in PACKED_VARIANTS)
            entry["packed"] = name in PACKED_VARIANTS
            if lengths == "kb":  # the cold pass a shard's first refresh pays: every length bucket's compile
                t0 = time.perf_counter()
                encode(enc, precision.autocast, store, batch[name])
                entry["first_pass_s"] = time.perf_counter() - t0
            sample = store.head(batch[name])
            t0 = time.perf_counter()
            encode(enc, precision.autocast, sample, batch[name])
            entry["first_call_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            encode(enc, precision.autocast, sample, batch[name])
            entry["second_call_s"] = time.perf_counter() - t0
            if compiled:
                entry["compile_s"] = entry["first_call_s"] - entry["second_call_s"]
            try:
                entry["sdpa"] = _attention_profile(
                    lambda e=enc, p=precision, d=sample, b=batch[name]: encode(e, p.autocast, d, b), dev)
            except Exception as e:  # noqa: BLE001 - the profile is a diagnostic only
                entry["sdpa"] = {"error": f"{type(e).__name__}: {e}"}
            encoders[name] = enc
            log(f"gpu_encode: {name} ready: first call {entry['first_call_s']:.1f} s, "
                f"attention {entry.get('attention')} ({entry['sdpa'].get('backend')})")
        except Exception as e:  # noqa: BLE001 - keep the other variants
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"gpu_encode: {name} FAILED: {entry['error']}")
            if is_cuda:
                torch.cuda.empty_cache()
        partial(result)

    # numerics: every variant against an fp32 encode of the same rows (at its own batch: no recompile)
    check = store.head(max(batch.values(), default=B))
    try:
        ref_enc = copy.deepcopy(base)
        prepare_encoder(ref_enc, encode_precision("fp32", "fp32", dev), "model", False, dev)
        ref = encode(ref_enc, None, check).vecs.double()
        del ref_enc
        got = {}
        for name, enc in encoders.items():
            v = encode(enc, encode_precision(*specs[name][:2], dev).autocast, check, batch[name]).vecs.double()
            rel = (v - ref).norm(dim=1) / ref.norm(dim=1)
            cos = torch.nn.functional.cosine_similarity(v, ref, dim=1)
            got[name] = v
            entries[name]["vs_fp32"] = {"rel_l2_max": float(rel.max()), "rel_l2_median": float(rel.median()),
                                        "cos_min": float(cos.min())}
        num: dict[str, Any] = {"rows": len(check)}
        a, c = "a_eager_fp32w_autocast", "c_eager_bf16w"
        if c in got:
            tol = bf16_tolerance(cfg["num_hidden_layers"])
            worst = entries[c]["vs_fp32"]["rel_l2_max"]
            if a in got:
                num["bf16w_vs_autocast_rel_l2_max"] = float(
                    ((got[c] - got[a]).norm(dim=1) / got[a].norm(dim=1)).max())
                worst = max(worst, num["bf16w_vs_autocast_rel_l2_max"])
            num["tolerance_rel_l2"] = tol
            num["bf16w_within_tolerance"] = worst <= tol
        for name, eager in (("b_compiled_fp32w_autocast", a), ("d_compiled_bf16w", c), ("e_compiled_layers_bf16w", c),
                            ("c_eager_bf16w_batch2x", c), ("f_packed_bf16w", c)):
            if name in got and eager in got:
                num[f"{name}_vs_eager_rel_l2_max"] = float(
                    ((got[name] - got[eager]).norm(dim=1) / got[eager].norm(dim=1)).max())
        result["numerics"] = num
    except Exception as e:  # noqa: BLE001
        result["numerics"] = {"error": f"{type(e).__name__}: {e}"}
    log(f"gpu_encode: numerics done ({time.perf_counter() - t_start:.1f} s)")
    partial(result)

    # the timed rounds, interleaved
    ac = {name: encode_precision(*specs[name][:2], dev).autocast for name in encoders}
    methods = {name: (lambda e=enc, a=ac[name], b=batch[name]: encode(e, a, store, b))
               for name, enc in encoders.items()}
    if methods:
        timed = _timed(methods, shape["repeats"], shape["warmup"], entries, log)
        for name, spread in timed.items():
            entries[name]["seconds"] = spread
            entries[name].update(_rates(spread, rows, flops["per_entity"], peak))
            if "first_pass_s" in entries[name]:
                entries[name]["first_pass_mfu"] = rows * flops["per_entity"] / entries[name]["first_pass_s"] / (
                    peak * 1e12)
    log(f"gpu_encode: timed rounds done ({time.perf_counter() - t_start:.1f} s): " + "; ".join(
        f"{n} {e['entities_per_s']['median']:.0f}/s MFU {e['mfu']['median']:.1%}" for n, e in entries.items()
        if "entities_per_s" in e))
    partial(result)
    try:
        result["sdpa_probe"] = sdpa_probe(dev, B, T, cfg["num_attention_heads"],
                                          cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_hidden_layers"])
    except Exception as e:  # noqa: BLE001
        result["sdpa_probe"] = {"error": f"{type(e).__name__}: {e}"}

    # summary
    timed_names = [n for n, e in entries.items() if "entities_per_s" in e]
    if timed_names:
        best = max(timed_names, key=lambda n: entries[n]["entities_per_s"]["median"])
        e = entries[best]
        result["best"] = {"variant": best, "entities_per_s_median": e["entities_per_s"]["median"],
                          "mfu_median": e["mfu"]["median"], "mfu_best": e["mfu"]["max"],
                          "refresh_kilt_8gpu_min_median": e["refresh_kilt_8gpu_min"]["median"],
                          "meets_60pct_median": e["mfu"]["median"] >= 0.60,
                          "ranking": sorted(timed_names, key=lambda n: -entries[n]["entities_per_s"]["median"])}
    shard = [n for n in specs if entries[n].get("shard_default")]
    result["shard_default"] = {
        "settings": "encode_dtype auto, encode_weights auto, encode_compile auto",
        "weights": str(default[0].weights).removeprefix("torch."),
        "autocast": None if default[0].autocast is None else str(default[0].autocast).removeprefix("torch."),
        "compile": default[1], "variant": shard[0] if shard else None}
    if shard and "entities_per_s" in entries[shard[0]]:
        e = entries[shard[0]]
        result["shard_default"].update(
            entities_per_s_median=e["entities_per_s"]["median"], mfu_median=e["mfu"]["median"],
            refresh_kilt_8gpu_min_median=e["refresh_kilt_8gpu_min"]["median"],
            first_refresh_extra_s=e.get("compile_s", 0.0), meets_60pct_median=e["mfu"]["median"] >= 0.60)
    for eager, compiled in (("a_eager_fp32w_autocast", "b_compiled_fp32w_autocast"),
                            ("c_eager_bf16w", "d_compiled_bf16w"), ("c_eager_bf16w", "e_compiled_layers_bf16w")):
        ee, ce = entries.get(eager, {}), entries.get(compiled, {})
        if "entities_per_s" in ee and "entities_per_s" in ce:
            re_, rc = ee["entities_per_s"]["median"], ce["entities_per_s"]["median"]
            saved = 1 / re_ - 1 / rc  # seconds saved per row
            result.setdefault("compile_break_even", {})[compiled] = {
                "speedup": rc / re_, "compile_s": ce.get("compile_s"),
                "rows_per_gpu_to_pay_back": ce.get("compile_s", 0.0) / saved if saved > 0 else None,
                "kilt_refreshes_on_8_gpus_to_pay_back": (ce.get("compile_s", 0.0) / saved) / (KILT_ROWS / GPUS)
                if saved > 0 else None}
    result["seconds_total"] = time.perf_counter() - t_start
    log(f"gpu_encode: done in {result['seconds_total']:.1f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU tests)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 GEMM peak (default: measured here)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--variants", default=None, help=f"comma-separated, some of {','.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--lengths", choices=["full", "kb"], default="full",
                    help=f"kb: rows of the synthetic KILT KB's token lengths, variants {','.join(KB_VARIANTS)} "
                         "by default, first pass and warm (issue 37 item 2)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    out = run(args.device, args.quick, args.peak_tflops, compile=not args.no_compile,
              variants=args.variants.split(",") if args.variants else None, lengths=args.lengths,
              partial=result_writer(args.out))
    text = json.dumps({**out, "complete": True}, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    for name, e in out["variants"].items():
        if "entities_per_s" in e:
            print(f"{name:45s} {e['entities_per_s']['median']:10.1f} entities/s  MFU {e['mfu']['median']:.1%}  "
                  f"KILT on 8 GPUs {e['refresh_kilt_8gpu_min']['median']:.2f} min", file=sys.stderr)
        else:
            print(f"{name:45s} {e.get('error')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
