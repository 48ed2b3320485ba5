"""One fused pass over a chunk of scores: each block's max and sum of exp(s - max), gold excluded.

The GPU block sampler's reduction (``dist_nce.sampling.block_fused``). Torch would take five
passes over the [B, C] score chunk for the same numbers (cast, max, subtract, exp, sum), each
reading and writing it; this kernel reads each score once and writes two floats per
(query, block): on a GPU the reduction costs a fraction of the GEMM that wrote the scores.

A program owns ``QT`` queries x one block of ``BR`` rows and always reduces in the same order,
whatever the chunk, the grid or the shard: a block's numbers have the same bits wherever it is
computed, which the sharded == flat guarantee needs.

Triton compiles it for CUDA tensors. For CPU tensors (tests on machines without a GPU) the
same function runs in Triton's interpreter, so the logic the GPU runs is what ``make test``
checks; no Triton at all means the callers keep their torch path (:func:`available`).
"""
from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Without a GPU Triton can only interpret; the switch is read when triton.language is
    # imported (its own helpers, tl.max among them, are decorated then).
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:  # optional: the GPU path only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str) -> str | None:
    """None when the kernel can run on ``device`` here, else why not."""
    if triton is None:
        return "triton is not installed"
    if torch.device(device).type != "cuda" and not _interpreting():
        return "triton was imported before dist_nce could select its interpreter (CPU tensors)"
    return None


if triton is not None:
    @triton.jit
    def _block_reduce(s_ptr, stride_s, gold_ptr, stride_g, col0, batch, mx_ptr, sum_ptr, stride_o,
                      QT: tl.constexpr, BR: tl.constexpr, NG: tl.constexpr):
        pid_q = tl.program_id(0)
        pid_j = tl.program_id(1)
        qs = pid_q * QT + tl.arange(0, QT)
        cols = pid_j * BR + tl.arange(0, BR)
        live_q = qs < batch
        s = tl.load(s_ptr + qs[:, None].to(tl.int64) * stride_s + cols[None, :], mask=live_q[:, None],
                    other=float("-inf")).to(tl.float32)
        rows = cols.to(tl.int64) + col0
        for g in tl.static_range(NG):  # the gold rows of each query: -inf, as topk.mask_gold does
            gr = tl.load(gold_ptr + qs.to(tl.int64) * stride_g + g, mask=live_q, other=-1)
            s = tl.where(gr[:, None] == rows[None, :], float("-inf"), s)
        top = tl.max(s, axis=1)
        ref = tl.where(top == float("-inf"), 0.0, top)  # a dead block: exp(-inf) = 0, log 0 = -inf
        mass = tl.sum(tl.exp(s - ref[:, None]), axis=1)
        out = qs.to(tl.int64) * stride_o + pid_j
        tl.store(mx_ptr + out, top, mask=live_q)
        tl.store(sum_ptr + out, mass, mask=live_q)


def block_reduce(scores: Tensor, gold: Tensor, col0: int, block_rows: int) -> tuple[Tensor, Tensor]:
    """Per block of ``block_rows`` columns: (max, sum exp(s - max)) of the gold-excluded scores.

    scores: [B, C] float32/bf16/fp16 row-major, columns = global rows [col0, col0 + C), C a
    multiple of ``block_rows`` (a power of two); -inf marks rows to leave out (other shards,
    dead rows). gold: [B, e] int64 global rows (-1 = none; e >= 0).
    Returns (top, mass), both [B, C / block_rows] float32: top = the block max (-inf for a block
    with no eligible row), mass = sum exp(s - top) computed against 0 instead of -inf, so that
    L_B = log(mass) + top is the block's logsumexp (-inf when empty) as in
    ``block_gumbel.block_log_mass``.
    """
    why = available(scores.device)
    if why is not None:
        raise RuntimeError(f"block_reduce: {why}")
    batch, width = scores.shape
    if block_rows & (block_rows - 1) or width % block_rows:
        raise ValueError(f"block_reduce: block_rows must be a power of two dividing the chunk width, got "
                         f"{block_rows} for {width}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    nb = width // block_rows
    top = torch.empty((batch, nb), dtype=torch.float32, device=scores.device)
    mass = torch.empty_like(top)
    gold = gold.to(device=scores.device, dtype=torch.int64).contiguous()
    ng = gold.shape[1]
    gold_arg = gold if ng else torch.full((batch, 1), -1, dtype=torch.int64, device=scores.device)
    if scores.device.type == "cuda":  # 16 queries x 128 rows: 8 KB of fp32 registers per program
        qt = 16 if block_rows <= 256 else 4
    else:  # the interpreter runs a program as numpy arrays: few large programs (same per-row result)
        qt = min(1 << (batch - 1).bit_length(), max(1, (1 << 18) // block_rows))
    grid = (-(-batch // qt), nb)
    with torch.profiler.record_function("dist_nce::block_reduce"):  # one launch, counted as one operator
        _block_reduce[grid](
            scores, scores.stride(0), gold_arg, gold_arg.stride(0), int(col0), batch, top, mass, top.stride(0),
            QT=qt, BR=block_rows, NG=ng, num_warps=4)
    return top, mass
