"""The exact search's steps 1-2 (``block_gumbel``) in one pass of a native CPU kernel.

Two kernels share one contract (``dist_nce/kernels/native``):

* ``block_lse.c`` (AVX512-BF16): bf16 queries and rows, VDPBF16PS;
* ``block_fp32.c`` (AVX2 + FMA, the CPUs without AVX512-BF16): fp32 queries against fp32 or
  bf16 rows, one FMA per product.

Each scores a block of ``block_rows`` rows against a tile of queries (fp32 sums in a fixed
order), reduces the block to L_B = logsumexp in registers, adds the block noise G_B and keeps,
per query, the k best blocks by (T desc, block asc) with their scores; the rest of the scores
are never written out. Step 3 (rows given their block maximum) is
``block_gumbel.rows_from_blocks``, unchanged, so the law, the counters, the tie rules and
``log_z`` are those of the torch path. With no seed the key of a block is its max, and the
k best blocks hold the exact top-k (``block_fused``'s argument). What differs from the torch
path is the arithmetic of a score (the kernel's fixed summation order, not BLAS's) and of
L_B (its own exp): another deterministic function of the same inputs, within a few float32
ulps. Every score has the same bits whichever tile, chunk, thread or shard computes it, so
sharded == flat bit for bit on whole blocks, as on the torch path. On bf16 queries and rows
the two kernels compute the same bits (``block_fp32.c`` repeats VDPBF16PS's sequence of exact
products), so which of them a machine runs does not change its draws.
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

BF16, FP32 = "block_lse", "block_fp32"  # the kernels, by source name; BF16 is preferred where both serve
KERNELS = {BF16: native.BLOCK, FP32: native.BLOCK_FP32}
_FP32_QT = 16  # queries per tile of block_fp32.c (checked against the library at its first call)


def pack_queries(q: Tensor, kernel: str = BF16) -> tuple[Tensor, int]:
    """Queries [B, d] -> the kernel's layout, zero-padded to a multiple of QT queries: bf16 pairs
    [tiles, d/2, QT] int32 (``block_lse``) or fp32 [tiles, d, QT] (``block_fp32``). Returns
    (packed, padded query count)."""
    qt = native.tile_queries() if kernel == BF16 else _FP32_QT
    batch, d = q.shape
    nqp = -(-batch // qt) * qt
    if kernel == FP32:
        padded = q.new_zeros((nqp, d), dtype=torch.float32)
        padded[:batch] = q
        return padded.view(nqp // qt, qt, d).transpose(1, 2).contiguous(), nqp
    padded = q.new_zeros((nqp, d), dtype=torch.bfloat16)
    padded[:batch] = q
    pairs = padded.view(torch.int32).view(nqp // qt, qt, d // 2)  # [tiles, QT, d/2]
    return pairs.transpose(1, 2).contiguous(), nqp


def _aligned(count: int, dtype) -> np.ndarray:
    """A 64-byte aligned scratch array of ``count`` elements."""
    size = np.dtype(dtype).itemsize
    raw = np.empty(count + 64 // size, dtype=dtype)
    off = (-raw.ctypes.data % 64) // size
    return raw[off:off + count]


class _State:
    """One thread's running state for a batch (the kernel's in/out arrays) and its scratch."""

    def __init__(self, batch: int, nqp: int, k: int, b: int, qt: int, d: int, kernel: str):
        self.k, self.b, self.kernel = k, b, kernel
        self.slot_t = torch.full((batch, k), NEG_INF, dtype=torch.float64)
        self.slot_j = torch.full((batch, k), -1, dtype=torch.int64)
        self.slot_c = torch.full((batch, k), -1, dtype=torch.int64)
        self.slot_scores = torch.full((batch, k, b), NEG_INF, dtype=torch.float32)
        self.thr = torch.full((nqp,), NEG_INF, dtype=torch.float64)
        self.lz_ref = torch.full((nqp,), NEG_INF, dtype=torch.float64)
        self.lz_sum = torch.zeros(nqp, dtype=torch.float64)
        self.buf = _aligned(b * qt, np.float32)  # one block's scores for one query tile
        if kernel == FP32:  # a heap of slots (slot_id: where each one's scores are), bf16 rows widened
            self.slot_id = torch.arange(k).repeat(batch, 1)  # a block at a time, and each row's address
            self.rows = _aligned(b * d, np.float32)
            self.row_ptrs = np.empty(b, dtype=np.uint64)
        else:
            self.wslot = torch.zeros(nqp, dtype=torch.int64)  # each query's worst slot

    def args(self, out_m: Tensor | None, out_s: Tensor | None) -> tuple:
        """The kernel's state arguments, from its slots to its scratch."""
        if self.kernel == FP32:
            return tuple(_ptr(x) for x in (self.slot_t, self.slot_j, self.slot_c, self.slot_id, self.slot_scores,
                                           self.thr, self.lz_ref, self.lz_sum, out_m, out_s, self.buf, self.rows,
                                           self.row_ptrs))
        return tuple(_ptr(x) for x in (self.slot_t, self.slot_j, self.slot_c, self.slot_scores, self.thr, self.wslot,
                                       self.lz_ref, self.lz_sum, out_m, out_s, self.buf))

    def stored(self) -> Tensor:
        """[B, k] where each slot's scores are in ``slot_scores`` (block_lse: in place)."""
        return self.slot_id if self.kernel == FP32 else torch.arange(self.k).expand(self.slot_t.shape[0], -1)

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


def _check_calls(calls: Sequence[Call], d: int, b: int, kernel: str) -> None:
    """The kernels read raw memory: every row a call may touch must be there (checked on any CPU)."""
    dtypes = (torch.bfloat16,) if kernel == BF16 else (torch.float32, torch.bfloat16)
    for call in calls:
        ent = call.ent
        if (ent.dtype not in dtypes or ent.dim() != 2 or ent.shape[1] != d or not ent.is_contiguous()
                or ent.device.type != "cpu" or not call.base <= call.lo <= call.hi <= call.base + ent.shape[0]
                or call.counters.numel() != call.j1 - call.j0 or call.j0 * b > call.lo or call.j1 * b < call.hi):
            raise ValueError(f"native block kernel: bad call rows [{call.lo}, {call.hi}) over {ent.dtype} "
                             f"{list(ent.shape)} at row {call.base} (contiguous {ent.is_contiguous()}), blocks "
                             f"[{call.j0}, {call.j1}) of {b} rows, {call.counters.numel()} counters")


def run_calls(calls: Sequence[Call], q: Tensor, k: int, gold: Tensor | None, dead: Tensor | None, seed: int | None,
              query_keys: Tensor | None, block_rows: int, threads: int = 1, out: list | None = None,
              kernel: str = BF16) -> tuple[BlockSet, Tensor]:
    """Steps 1-2 of the block sampler (``seed`` None: the exact top-k's blocks) over ``calls``
    (ascending, disjoint blocks), on ``kernel`` (BF16 or FP32).

    q: [B, d] queries, bf16 for BF16, fp32 for FP32; gold: [B] or [B, e] int64 global rows (-1
    none); dead: sorted int64 global rows; ``threads`` > 1 splits the calls into contiguous
    groups run in parallel (the kernel releases the GIL) and merges them (the same answer bit
    for bit). ``out`` (tests) collects per call the kernel's block max and sum of exp [B, j1 - j0].
    Returns (the k best blocks [B, k] sorted by counter, -1 counters for empty slots, ``top``
    their T, or their max for top-k; log_z [B] float64, the gold-excluded logsumexp of every
    row scored).
    """
    batch, d = q.shape
    b = block_rows
    _check_calls(calls, d, b, kernel)
    lib = KERNELS[kernel].library()
    if kernel == FP32 and lib.dnce_fp32_qt() != _FP32_QT:
        raise RuntimeError(f"block_fp32 packs {lib.dnce_fp32_qt()} queries per tile, block_native {_FP32_QT}")
    packed, nqp = pack_queries(q, kernel)
    qt = nqp // packed.shape[0]
    gold2 = torch.empty((batch, 0), dtype=torch.int64) if gold is None else \
        (gold[:, None] if gold.dim() == 1 else gold).to(torch.int64).contiguous()
    dead = torch.empty(0, dtype=torch.int64) if dead is None else dead.to(torch.int64).contiguous()

    # noise rows first ([nb, nqp]: a block's noise for a tile of queries at once), padded queries keyed 0
    keys = None if seed is None else torch.cat([query_keys, query_keys.new_zeros(nqp - batch)])

    def work(group: Sequence[Call]) -> _State:
        state = _State(batch, nqp, k, b, qt, d, kernel)
        for call in group:
            nb = call.j1 - call.j0
            noise = None if seed is None else block_noise(seed, keys, call.counters, rows_first=True)
            excl = dead if not call.exclude.numel() else torch.cat([dead, call.exclude]).sort().values
            om = os_ = None
            if out is not None:
                om, os_ = torch.empty((batch, nb), dtype=torch.float32), torch.empty((batch, nb), dtype=torch.float32)
                out.append((call, om, os_))
            what = (call.base, d, call.lo, call.hi, b, call.j0, call.j1, _ptr(packed), batch, _ptr(noise),
                    _ptr(call.counters), _ptr(gold2), gold2.shape[1], _ptr(excl), excl.numel(), k)
            if kernel == FP32:
                rc = lib.dnce_fp32_block_topk(_ptr(call.ent), int(call.ent.dtype == torch.bfloat16), *what,
                                              *state.args(om, os_))
            else:
                rc = lib.dnce_block_topk(_ptr(call.ent), *what, *state.args(om, os_))
            if rc:
                raise ValueError(f"native block kernel {kernel} rejected its arguments (d={d}, block_rows={b}, k={k})")
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
    """The k best blocks of all states by (T desc, counter asc), sorted by counter; their scores
    gathered once from where each state wrote them."""
    top = torch.cat([s.slot_t for s in states], dim=1)
    counters = torch.cat([s.slot_c for s in states], dim=1)
    stored = torch.cat([s.stored() + i * s.k for i, s in enumerate(states)], dim=1)  # slot -> scores row
    order = torch.sort(counters, dim=1, stable=True).indices  # select_topk: ties -> lower position
    top, counters = top.gather(1, order), counters.gather(1, order)
    if top.shape[1] > k:
        pos = select_topk(top, k).sort(dim=1).values
        top, counters, order = top.gather(1, pos), counters.gather(1, pos), order.gather(1, pos)
    scores = states[0].slot_scores if len(states) == 1 else torch.cat([s.slot_scores for s in states], dim=1)
    at = stored.gather(1, order)
    return BlockSet(top, counters, scores.gather(1, at[:, :, None].expand(-1, -1, scores.shape[2])))


def choose(spec_is_dot: bool, queries: Tensor, entities: Tensor, block_rows: int) -> tuple[str | None, str | None]:
    """(the kernel that serves this search, None), or (None, why neither does): ``block_lse``
    where it can (4x the fp32 rate), else ``block_fp32``."""
    common = _common_reason(spec_is_dot, queries, entities)
    if common is not None:
        return None, common
    reasons = {}
    for name, reason in ((BF16, _bf16_reason), (FP32, _fp32_reason)):
        reasons[name] = reason(queries, entities, block_rows)
        if reasons[name] is None:
            return name, None
    return None, "; ".join(f"{name}: {why}" for name, why in reasons.items())


def usable(spec_is_dot: bool, queries: Tensor, entities: Tensor, block_rows: int, kernel: str | None = None
           ) -> str | None:
    """Why ``kernel`` (None: either) cannot serve this search (None when it can)."""
    if kernel is None:
        return choose(spec_is_dot, queries, entities, block_rows)[1]
    return _common_reason(spec_is_dot, queries, entities) or \
        {BF16: _bf16_reason, FP32: _fp32_reason}[kernel](queries, entities, block_rows)


def _common_reason(spec_is_dot: bool, queries: Tensor, entities: Tensor) -> str | None:
    if not spec_is_dot:
        return "the score is not a single-vector dot product"
    if entities.dim() != 2 or queries.dim() != 2:
        return "the entity rows are not [n, d]"
    if entities.device.type != "cpu" or queries.device.type != "cpu":
        return "the rows are not on the CPU"
    return None


def _bf16_reason(queries: Tensor, entities: Tensor, block_rows: int) -> str | None:
    if entities.dtype != torch.bfloat16:
        return "the entity rows are not bf16 (index.score_dtype bf16)"
    if entities.shape[1] % 2:
        return f"d={entities.shape[1]} is odd"
    if queries.dtype != torch.bfloat16 and not torch.equal(queries.to(torch.bfloat16).to(queries.dtype), queries):
        # the kernel multiplies bf16 values: it serves the scores the config defines only when the
        # queries are bf16 values already (index.score_dtype bf16 rounds them; storage bf16 alone does not)
        return "the queries are not bf16 values (index.score_dtype bf16 rounds them)"
    missing = native.BLOCK.unavailable_reason()
    if missing is not None:
        return f"the kernel is unavailable on this machine ({missing})"
    if block_rows % native.rows_per_microtile():
        return f"block_rows={block_rows} is not a multiple of {native.rows_per_microtile()}"
    return None


def _fp32_reason(queries: Tensor, entities: Tensor, block_rows: int) -> str | None:
    if entities.dtype not in (torch.float32, torch.bfloat16):
        return f"the entity rows are {entities.dtype}, not fp32 or bf16"
    if queries.dtype != torch.float32:
        # fp32 products and sums: what torch computes for index.compute fp32, not for bf16/fp16 compute
        return f"the queries are {queries.dtype}, not fp32 (index.compute fp32)"
    missing = native.BLOCK_FP32.unavailable_reason()
    if missing is not None:
        return f"the kernel is unavailable on this machine ({missing})"
    return None
