"""The block sampler's steps 1-2 (``block_gumbel``) in one pass of the native kernel.

For single-vector (dual) reps held in bf16, ``native/block_lse.c`` scores each block of
``block_rows`` rows against a tile of queries (fp32 sums of exact bf16 products), reduces the
block to L_B = logsumexp in registers, adds the block noise G_B and keeps, per query, the k
best blocks by (T desc, block asc) with their scores; the rest of the scores are never
written out. Step 3 (rows given their block maximum) is ``block_gumbel.rows_from_blocks``,
unchanged, so the law, the counters, the tie rules and ``log_z`` are those of the torch
path. What differs from it is the arithmetic of a score (the kernel's fixed summation order,
not BLAS's) and of L_B (its own exp): another deterministic function of the same inputs,
within a few float32 ulps. Every score has the same bits whichever tile, chunk, thread or
shard computes it, so sharded == flat bit for bit on whole blocks, as on the torch path.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from dist_nce.kernels import build as native
from dist_nce.sampling.block_gumbel import BlockSet, block_noise
from dist_nce.sampling.topk import NEG_INF, select_topk


def pack_queries(q: Tensor) -> tuple[Tensor, int]:
    """bf16 queries [B, d] -> the kernel's layout [tiles, d/2, QT] int32 (bf16 pairs), zero-padded
    to a multiple of QT queries. Returns (packed, padded query count)."""
    qt = native.tile_queries()
    batch, d = q.shape
    nqp = -(-batch // qt) * qt
    padded = q.new_zeros((nqp, d), dtype=torch.bfloat16)
    padded[:batch] = q
    pairs = padded.view(torch.int32).view(nqp // qt, qt, d // 2)  # [tiles, QT, d/2]
    return pairs.transpose(1, 2).contiguous(), nqp


class _State:
    """One thread's running state for a batch (the kernel's in/out arrays)."""

    def __init__(self, batch: int, nqp: int, k: int, b: int):
        self.k, self.b = k, b
        self.slot_t = torch.full((batch, k), NEG_INF, dtype=torch.float64)
        self.slot_j = torch.full((batch, k), -1, dtype=torch.int64)
        self.slot_c = torch.full((batch, k), -1, dtype=torch.int64)
        self.slot_scores = torch.full((batch, k, b), NEG_INF, dtype=torch.float32)
        self.thr = torch.full((nqp,), NEG_INF, dtype=torch.float64)
        self.wslot = torch.zeros(nqp, dtype=torch.int64)
        self.lz_ref = torch.full((nqp,), NEG_INF, dtype=torch.float64)
        self.lz_sum = torch.zeros(nqp, dtype=torch.float64)
        # 64-byte aligned scratch of b x QT floats
        raw = np.empty(b * native.tile_queries() + 16, dtype=np.float32)
        off = (-raw.ctypes.data % 64) // 4
        self.buf = raw[off:off + b * native.tile_queries()]
        self._raw = raw

    def log_z(self) -> Tensor:
        # mass = lz_sum * 2^lz_ref; -inf + log 0 = -inf: no eligible row
        return self.lz_ref * math.log(2.0) + self.lz_sum.log()


class Call(NamedTuple):
    """One kernel call: rows [lo, hi) of ``ent`` (row g at ent[g - base]), the grid blocks
    [j0, j1) meeting them, extra rows to exclude (sorted global), the blocks' counters."""

    ent: Tensor
    base: int
    lo: int
    hi: int
    j0: int
    j1: int
    exclude: Tensor
    counters: Tensor


def _ptr(x: Tensor | np.ndarray | None) -> int | None:
    if x is None:
        return None
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def run_calls(calls: Sequence[Call], q: Tensor, k: int, gold: Tensor | None, dead: Tensor | None, seed: int,
              query_keys: Tensor, block_rows: int, threads: int = 1,
              out: list | None = None) -> tuple[BlockSet, Tensor]:
    """Steps 1-2 of the block sampler over ``calls`` (ascending, disjoint blocks).

    q: [B, d] bf16 queries; gold: [B] or [B, e] int64 global rows (-1 none); dead: sorted
    int64 global rows; ``threads`` > 1 splits the calls into contiguous groups run in
    parallel (the kernel releases the GIL) and merges them (the same answer bit for bit).
    ``out`` (tests) collects per call the kernel's block max and sum of exp [B, j1 - j0].
    Returns (the k best blocks [B, k] sorted by counter, -1 counters for empty slots;
    log_z [B] float64, the gold-excluded logsumexp of every row scored).
    """
    batch, d = q.shape
    b = block_rows
    for call in calls:  # the kernel reads raw memory: every row it may touch must be there (checked on any CPU)
        ent = call.ent
        if (ent.dtype != torch.bfloat16 or ent.dim() != 2 or ent.shape[1] != d or not ent.is_contiguous()
                or ent.device.type != "cpu" or not call.base <= call.lo <= call.hi <= call.base + ent.shape[0]
                or call.counters.numel() != call.j1 - call.j0 or call.j0 * b > call.lo or call.j1 * b < call.hi):
            raise ValueError(f"native block kernel: bad call rows [{call.lo}, {call.hi}) over {ent.dtype} "
                             f"{list(ent.shape)} at row {call.base} (contiguous {ent.is_contiguous()}), blocks "
                             f"[{call.j0}, {call.j1}) of {b} rows, {call.counters.numel()} counters")
    lib = native.library()
    packed, nqp = pack_queries(q)
    gold2 = torch.empty((batch, 0), dtype=torch.int64) if gold is None else \
        (gold[:, None] if gold.dim() == 1 else gold).to(torch.int64).contiguous()
    dead = torch.empty(0, dtype=torch.int64) if dead is None else dead.to(torch.int64).contiguous()

    def work(group: Sequence[Call]) -> _State:
        state = _State(batch, nqp, k, b)
        for call in group:
            nb = call.j1 - call.j0
            noise = torch.zeros((nb, nqp), dtype=torch.float64)
            noise[:, :batch] = block_noise(seed, query_keys, call.counters).T
            excl = dead if not call.exclude.numel() else torch.cat([dead, call.exclude]).sort().values
            om = os_ = None
            if out is not None:
                om, os_ = torch.empty((batch, nb), dtype=torch.float32), torch.empty((batch, nb), dtype=torch.float32)
                out.append((call, om, os_))
            rc = lib.dnce_block_topk(
                _ptr(call.ent), call.base, d, call.lo, call.hi, b, call.j0, call.j1, _ptr(packed), batch,
                _ptr(noise), _ptr(call.counters), _ptr(gold2), gold2.shape[1], _ptr(excl), excl.numel(), k,
                _ptr(state.slot_t), _ptr(state.slot_j), _ptr(state.slot_c), _ptr(state.slot_scores),
                _ptr(state.thr), _ptr(state.wslot), _ptr(state.lz_ref), _ptr(state.lz_sum), _ptr(om), _ptr(os_),
                _ptr(state.buf))
            if rc:
                raise ValueError(f"native block kernel rejected its arguments (d={d}, block_rows={b}, k={k})")
        return state

    groups = _split(list(calls), max(1, threads))
    if len(groups) == 1:
        states = [work(groups[0])]
    else:
        with ThreadPoolExecutor(len(groups)) as pool:
            states = list(pool.map(work, groups))
    return _merge(states, k), torch.stack([s.log_z()[:batch] for s in states]).logsumexp(dim=0)


def _split(calls: list[Call], parts: int) -> list[list[Call]]:
    """Contiguous groups of about equal row counts (thread i takes the i-th group)."""
    if parts <= 1 or len(calls) <= 1:
        return [calls]
    sizes = np.array([c.hi - c.lo for c in calls], dtype=np.float64)
    cuts = np.searchsorted(np.cumsum(sizes), sizes.sum() * np.arange(1, parts) / parts)
    bounds = [0, *sorted(set(int(c) + 1 for c in cuts)), len(calls)]
    return [calls[a:z] for a, z in zip(bounds, bounds[1:]) if z > a]


def _merge(states: list[_State], k: int) -> BlockSet:
    """The k best blocks of all states by (T desc, counter asc), sorted by counter."""
    top = torch.cat([s.slot_t for s in states], dim=1)
    counters = torch.cat([s.slot_c for s in states], dim=1)
    scores = torch.cat([s.slot_scores for s in states], dim=1)
    order = torch.sort(counters, dim=1, stable=True).indices  # select_topk: ties -> lower position
    top, counters = top.gather(1, order), counters.gather(1, order)
    if top.shape[1] > k:
        pos = select_topk(top, k).sort(dim=1).values
        top, counters, order = top.gather(1, pos), counters.gather(1, pos), order.gather(1, pos)
    scores = scores.gather(1, order[:, :, None].expand(-1, -1, scores.shape[2]))
    return BlockSet(top, counters, scores)


def usable(spec_is_dot: bool, queries: Tensor, entities: Tensor, block_rows: int) -> str | None:
    """Why the kernel cannot serve this search (None when it can)."""
    if not spec_is_dot:
        return "the score is not a single-vector dot product"
    if entities.dtype != torch.bfloat16 or entities.dim() != 2 or queries.dim() != 2:
        return "the entity rows are not bf16 [n, d] (index.score_dtype bf16)"
    if entities.device.type != "cpu" or queries.device.type != "cpu":
        return "the rows are not on the CPU"
    if entities.shape[1] % 2:
        return f"d={entities.shape[1]} is odd"
    if queries.dtype != torch.bfloat16 and not torch.equal(queries.to(torch.bfloat16).to(queries.dtype), queries):
        # the kernel multiplies bf16 values: it serves the scores the config defines only when the
        # queries are bf16 values already (index.score_dtype bf16 rounds them; storage bf16 alone does not)
        return "the queries are not bf16 values (index.score_dtype bf16 rounds them)"
    missing = native.unavailable_reason()
    if missing is not None:
        return f"the kernel is unavailable on this machine ({missing})"
    if block_rows % native.rows_per_microtile():
        return f"block_rows={block_rows} is not a multiple of {native.rows_per_microtile()}"
    return None
