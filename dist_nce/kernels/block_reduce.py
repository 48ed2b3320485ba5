"""One fused pass over a chunk of scores: every block's log-mass and its ranking key.

The GPU block sampler's (and exact top-k's) reduction, ``dist_nce.sampling.block_fused``. Per
(query, block of ``block_rows`` rows) it reads the chunk's scores once, sets the gold to -inf,
and writes

* ``log_mass`` L_B = log sum exp(s) (float64: fp32 max and sum of exp(s - max), the log in
  float64, as ``block_gumbel.block_log_mass``), -inf for a block without an eligible row;
* ``key``: with a seed, the block maximum T_B = L_B + G_B (``block_gumbel.block_maxima``) with
  the block's Gumbel G_B hashed in place from (seed, query key, block counter) as
  ``block_gumbel.block_noise`` does; without, the block's max packed with its position into
  one int64 that orders by (max desc, position asc), so ``torch.topk`` has no tie to break.

Torch would take a dozen passes over the [B, C] chunk and ~85 launches of noise for the same
numbers. A program owns ``QT`` queries x one block and always reduces in the same order,
whatever the chunk, the grid or the shard: a block's numbers have the same bits wherever it is
computed, which the sharded == flat guarantee needs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_nce.kernels.triton_base import BLOCK_COUNTER_BIT, available, seed_hash, tl, triton

__all__ = ["available", "block_keys"]

if triton is not None:
    from dist_nce.kernels.triton_base import gumbel_of, mix

    @triton.jit
    def _block_keys(s_ptr, stride_s, gold_ptr, stride_g, keys_ptr, seed_bits, col0, lo, j0, pos0, low32, batch,
                    key_ptr, stride_k, lm_ptr, stride_l,
                    QT: tl.constexpr, BR: tl.constexpr, NG: tl.constexpr, SAMPLE: tl.constexpr):
        pid_q = tl.program_id(0)
        pid_j = tl.program_id(1)
        qs = pid_q * QT + tl.arange(0, QT)
        live_q = qs < batch
        block = j0 + pid_j
        cols = block * BR + tl.arange(0, BR)
        s = tl.load(s_ptr + qs[:, None].to(tl.int64) * stride_s + cols[None, :], mask=live_q[:, None],
                    other=float("-inf")).to(tl.float32)
        rows = cols.to(tl.int64) + col0
        for g in tl.static_range(NG):  # the gold rows of each query: -inf, as topk.mask_gold does
            gr = tl.load(gold_ptr + qs.to(tl.int64) * stride_g + g, mask=live_q, other=-1)
            s = tl.where(gr[:, None] == rows[None, :], float("-inf"), s)
        top = tl.max(s, axis=1)
        ref = tl.where(top == float("-inf"), 0.0, top)  # a dead block: exp(-inf) = 0, log 0 = -inf
        mass = tl.sum(tl.exp(s - ref[:, None]), axis=1)
        log_mass = tl.log(mass.to(tl.float64)) + top.to(tl.float64)
        tl.store(lm_ptr + qs.to(tl.int64) * stride_l + pid_j, log_mass, mask=live_q)
        if SAMPLE:
            # the block's counter: its first row in this call's range (block_gumbel.block_noise)
            counter = tl.maximum((col0 + block * BR).to(tl.int64), lo.to(tl.int64)) | 4611686018427387904
            key = tl.load(keys_ptr + qs, mask=live_q, other=0).to(tl.uint64, bitcast=True)
            q = mix(key ^ seed_bits.to(tl.int64).to(tl.uint64, bitcast=True))
            noise = gumbel_of(q, counter.to(tl.uint64, bitcast=True))
            tl.store(key_ptr + qs.to(tl.int64) * stride_k + pid_j, log_mass + noise, mask=live_q)
        else:
            bits = (top + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # + 0.0: -0.0 becomes +0.0
            bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
            packed = (bits << 32) | (low32 - (pos0 + pid_j).to(tl.int64))
            tl.store(key_ptr + qs.to(tl.int64) * stride_k + pid_j, packed, mask=live_q)


def block_keys(scores: Tensor, gold: Tensor, col0: int, block_rows: int, j0: int, j1: int, log_mass: Tensor,
               keys: Tensor, seed: int | None = None, query_keys: Tensor | None = None, lo: int = 0,
               pos0: int = 0) -> None:
    """Fill ``log_mass`` and ``keys`` [B, j1 - j0] for blocks [j0, j1) of a chunk (module docstring).

    scores: [B, C] float32/bf16 row-major, columns = global rows [col0, col0 + C), C a multiple
    of ``block_rows`` (a power of two); -inf marks rows to leave out (other shards, dead rows).
    gold: [B, e] int64 global rows (-1 = none; e >= 0). log_mass: float64 output (a column
    slice of a larger buffer is fine). keys: float64 T_B with ``seed`` (query_keys [B] int64;
    ``lo`` the first row of the call's range in this chunk: a block's counter is
    max(its first row, lo)), else int64 (max, position) keys, positions from ``pos0``.
    """
    why = available(scores.device)
    if why is not None:
        raise RuntimeError(f"block_keys: {why}")
    batch, width = scores.shape
    if block_rows & (block_rows - 1) or width % block_rows:
        raise ValueError(f"block_keys: block_rows must be a power of two dividing the chunk width, got "
                         f"{block_rows} for {width}")
    n = j1 - j0
    if log_mass.shape != (batch, n) or keys.shape != (batch, n):
        raise ValueError(f"block_keys: outputs must be [{batch}, {n}], got {list(log_mass.shape)}, {list(keys.shape)}")
    if not n or not batch:
        return
    sample = seed is not None
    if keys.dtype != (torch.float64 if sample else torch.int64) or log_mass.dtype != torch.float64:
        raise ValueError("block_keys: log_mass must be float64 and keys float64 (seed) or int64 (no seed)")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    gold = gold.to(device=scores.device, dtype=torch.int64).contiguous()
    ng = gold.shape[1]
    gold_arg = gold if ng else torch.full((batch, 1), -1, dtype=torch.int64, device=scores.device)
    qkeys = query_keys.to(scores.device).contiguous() if sample else gold_arg
    if scores.device.type == "cuda":  # 16 queries x 128 rows: 8 KB of fp32 registers per program
        qt = 16 if block_rows <= 256 else 4
    else:  # the interpreter runs a program as numpy arrays: few large programs (same per-row result)
        qt = min(1 << (batch - 1).bit_length(), max(1, (1 << 18) // block_rows))
    grid = (-(-batch // qt), n)
    with torch.profiler.record_function("dist_nce::block_keys"):  # one launch, counted as one operator
        _block_keys[grid](
            scores, scores.stride(0), gold_arg, gold_arg.stride(0), qkeys, seed_hash(seed) if sample else 0,
            int(col0), int(lo), int(j0), int(pos0), (1 << 32) - 1, batch, keys, keys.stride(0), log_mass,
            log_mass.stride(0), QT=qt, BR=block_rows, NG=ng, SAMPLE=sample, num_warps=4)


assert BLOCK_COUNTER_BIT == 4611686018427387904  # the literal in the kernel
