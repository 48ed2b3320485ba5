"""Exact Gumbel-top-k at top-k cost: top-down sampling over a fixed global grid of row blocks.

The dense sampler (``negatives.gumbel_topk_dense``) draws one Gumbel per (query, row): the
top K-1 of s_i + G_i is K-1 rows without replacement proportional to exp(s) (Plackett-Luce
order). Here the same law is drawn top-down, with noise for N/b blocks plus (K-1) x b rows
per query (b = ``block_rows``):

1. **Block maxima.** The global rows are cut into blocks [j*b, (j+1)*b). For independent
   G_i ~ Gumbel(0), max_{i in B} (s_i + G_i) ~ Gumbel(L_B), L_B = logsumexp_{i in B} s_i
   (Maddison et al. 2014, "A* sampling", sec. 2; Kool et al. 2019, "Stochastic Beams and
   Where to Find Them", eq. 7). So each block's maximum key is drawn directly:
   T_B = L_B + G_B, G_B from counter-based noise of the block (:func:`block_noise`, a counter
   stream disjoint from the per-row one).
2. **Keep the K-1 best blocks.** The maximum key of a block is the key of one of its rows,
   so a block with K-1 blocks ahead of it (by T desc, then block id asc) has K-1 rows ahead
   of each of its rows, and none of its rows is in the top K-1: every row of the top K-1
   lies in the K-1 best blocks (:class:`BlockStream`; :func:`keep_best_blocks` is its simple
   reference). L_B is one float32 pass over the scores (:func:`block_log_mass`); only blocks
   whose T reaches the running (K-1)-th maximum have their scores copied out of the chunk.
3. **Rows given their block maximum.** Inside a kept block, draw unconditioned keys
   phi_i = s_i + G_i with the per-row noise G_i = ``gumbel_noise(seed, query key, row)``,
   Z = max_i phi_i, and set (Kool et al. 2019, eq. 23; Maddison et al. 2014, sec. 4)

       key_i = -log(exp(-T) - exp(-Z) + exp(-phi_i)),

   i.e. the keys conditioned on their maximum being T. The row at Z gets exactly T. Computed
   in the numerically stable form of Kool et al. 2019, appendix B.3 (:func:`truncated_gumbel`).

Jointly, the keys of all rows (those of dropped blocks are never computed) have the law of
independent Gumbel(s_i): T_B ~ Gumbel(L_B) is the law of the block maximum, and given the
maximum eq. 23 gives the conditional law of the keys, independently across blocks (distinct
counters). Hence the top K-1 rows by key is exactly the dense sampler's law: K-1 without
replacement, proportional to exp(s), in successive-sampling order, gold excluded (gold
scores are -inf before L_B is taken). ``log_z`` keeps its meaning (gold-excluded logsumexp
of the rows searched). The samples differ from the dense sampler's draw for draw (another
coupling of the same law); the dense sampler stays the reference.

**Sharded == flat.** A row's key is a pure function of (seed, query key, its block's scores,
its row): it does not depend on which shard computes it, provided the block lies in one
shard. Each shard keeps its own K-1 best blocks, which hold its own top K-1 rows (step 2 on
the shard); the global top K-1 rows are among the union of the shards' top K-1 rows, so
``merge_results`` of the shards' answers is the flat answer bit for bit (same keys, same
(key desc, row asc) order), given bit-identical scores (``index.exact.exact_search``'s grid).

A shard whose rows start or end inside a block (``row_start`` not a multiple of b) owns only
a PIECE of it. The piece is treated as a block of its own: its maximum is drawn from the
piece's logsumexp with the noise of the piece's first row (distinct from the other piece's),
so the sample is still exact, but the flat search draws that block whole: bit-for-bit
equality with flat holds only when every shard starts on the block grid.

Tie rule: blocks ordered by (T desc, first row asc); rows by (key desc, row asc). Blocks are
contiguous ranges, so a block that wins a tie on T holds a row that wins the same tie on key.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dist_nce.sampling.noise import gumbel_noise
from dist_nce.sampling.topk import NEG_INF, ShardResult, mask_gold, result_from_keys, select_topk

# Block counters are rows with bit 62 set: gumbel_noise hashes (row ^ salt) through a bijection,
# so the block stream never meets the per-row stream of any row < 2**62.
BLOCK_COUNTER_BIT = 1 << 62


def block_noise(seed: int, query_keys: Tensor, block_counters: Tensor, rows_first: bool = False) -> Tensor:
    """Standard Gumbel noise G_B [B, nb] float64 for block counters [nb] or [B, nb] int64
    (``rows_first``: [nb, B], the same values, for counters [nb]).

    The counter of a block is its first global row (of the piece a shard owns); the stream
    is ``negatives.gumbel_noise`` at rows counter | 2**62, disjoint from every row's noise.
    """
    rows = block_counters | BLOCK_COUNTER_BIT
    return gumbel_noise(seed, query_keys, rows, rows_first=True) if rows_first else gumbel_noise(seed, query_keys, rows)


def log1mexp(a: Tensor) -> Tensor:
    """log(1 - exp(a)) for a <= 0, stable at both ends (Maechler 2012): -inf at a = 0."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def truncated_gumbel(phi: Tensor, top: Tensor) -> Tensor:
    """Keys conditioned on their maximum: Kool et al. 2019 eq. 23, stable form (appendix B.3).

    phi: [..., b] float64 unconditioned keys s_i + G_i (-inf for masked rows);
    top: [...] float64 the maximum T the keys must have.
    Returns [..., b] float64 -log(exp(-T) - exp(-Z) + exp(-phi_i)), Z = max_i phi_i (see
    :func:`truncate`); the argmax row gets T exactly, masked rows (and every row when
    T = -inf) get -inf.
    """
    return truncate(phi, phi.amax(dim=-1, keepdim=True), top.unsqueeze(-1))


def truncate(phi: Tensor, z: Tensor, t: Tensor) -> Tensor:
    """Elementwise eq. 23 (broadcasting): key = T - softplus(v), v = T - phi + log(1 - exp(phi - Z)),
    for unconditioned keys ``phi`` of a block whose unconditioned maximum is ``z`` and whose
    maximum must be ``t``; -inf where phi or t is -inf."""
    v = t - phi + log1mexp(phi - z)
    out = t - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))
    dead = (phi == NEG_INF) | (t == NEG_INF)
    return torch.where(dead, torch.full_like(out, NEG_INF), out)


class BlockSet(NamedTuple):
    """The K-1 (or fewer) best blocks of a batch so far, block counter ascending along dim 1.

    top:      [B, c] float64 block maxima T = L + G (-inf: no eligible row).
    counters: [B, c] int64 first global row of each block (piece); -1 marks an empty slot.
    scores:   [B, c, b] float32 the block's scores in grid layout (block start = counter // b * b),
              -inf for the gold and rows outside the block's piece.
    """

    top: Tensor
    counters: Tensor
    scores: Tensor


def block_log_mass(blocks: Tensor) -> Tensor:
    """L_B = logsumexp of each block [B, nb] float64, from blocks [B, nb, b] float32 masked scores.

    One float32 pass (max, exp(s - max), sum), not a float64 copy of the whole score chunk:
    the max is exact, s - max is exact for s within a factor 2 of it (Sterbenz) and each
    exp(s - max) <= 1 is within ~1 ulp, so |L_B - logsumexp_f64| <= ~(1 + log2 b) 2^-24
    (~5e-7 for b = 128; tests/sampling/test_block_gumbel.py checks < 1e-6): below the float32
    rounding of the scores themselves (|s| 2^-24 ... 2^-23), and a mass error of a factor
    exp(5e-7) in the law of T_B. -inf for a block with no eligible row (gold only, or outside
    the shard). Elementwise kernels may round a vector body and a scalar tail differently:
    callers reduce chunks of one fixed shape, so a block's L_B has the same bits on every shard.
    """
    top = blocks.amax(dim=-1, keepdim=True)
    top = top.masked_fill(top == NEG_INF, 0.0)  # a dead block: exp(-inf - 0) = 0, log 0 = -inf
    mass = torch.sub(blocks, top).exp_().sum(dim=-1)
    return mass.double().log_().add_(top.squeeze(-1).double())


def block_maxima(log_mass: Tensor, counters: Tensor, seed: int, query_keys: Tensor) -> Tensor:
    """Block maxima T_B = L_B + G_B ~ Gumbel(L_B) [B, nb] float64 (A* sampling, sec. 2).

    log_mass: [B, nb] float64 from :func:`block_log_mass`; counters: [nb] int64 first global
    row of each block's piece (:func:`block_noise`).
    """
    return log_mass + block_noise(seed, query_keys, counters)


# Candidate keys: query b, block position j (within the stream) -> b * 2**40 + j.
_KEY_SHIFT = 1 << 40


class BlockStream:
    """The K-1 best blocks of a stream of score chunks, holding scores of a few blocks only.

    Every block's maximum T_B (step 1) is kept ([B, N/b] float64: 8 bytes per block and
    query). A block's scores [b] are copied out of its chunk only when its T_B reaches the
    running k-th largest T of the blocks seen so far (a lower bound of the final k-th
    largest, so every block of the final top k is copied when it arrives): ~k (1 + ln(N/(b k)))
    blocks per query for exchangeable T, not N/b, and no top-k over the rows of a chunk.
    :meth:`finish` picks the k best blocks by (T desc, position asc) over ALL blocks at
    once: position order is counter order (blocks arrive in row order), the tie rule of
    :func:`keep_best_blocks`.
    """

    def __init__(self, k: int, seed: int, query_keys: Tensor, block_rows: int):
        self.k, self.seed, self.query_keys, self.block_rows = k, seed, query_keys, block_rows
        batch = query_keys.shape[0]
        self.log_z = torch.full((batch,), NEG_INF, dtype=torch.float64, device=query_keys.device)
        self._tops: list[Tensor] = []
        self._counters: list[Tensor] = []
        self._best: Tensor | None = None  # [B, <= k] float64 the k largest T so far, descending
        self._keys: list[Tensor] = []
        self._scores: list[Tensor] = []
        self._seen = 0

    def add(self, blocks: Tensor, log_mass: Tensor, counters: Tensor) -> None:
        """A chunk of blocks [B, nb, b] float32 (-inf for gold and rows outside the piece), their
        ``log_mass`` [B, nb] float64 (:func:`block_log_mass`) and counters [nb] int64 ascending."""
        top = block_maxima(log_mass, counters, self.seed, self.query_keys)
        self.log_z = torch.logaddexp(self.log_z, torch.logsumexp(log_mass, dim=1))
        both = top if self._best is None else torch.cat([self._best, top], dim=1)
        self._best = torch.topk(both, min(self.k, both.shape[1]), dim=1).values  # sorted descending
        if self._best.shape[1] >= self.k:
            hit = top >= self._best[:, self.k - 1:self.k]
        else:
            hit = torch.ones_like(top, dtype=torch.bool)
        qb, j = hit.nonzero(as_tuple=True)
        self._keys.append(qb * _KEY_SHIFT + (j + self._seen))
        self._scores.append(blocks[qb, j])
        self._tops.append(top)
        self._counters.append(counters)
        self._seen += top.shape[1]

    def finish(self) -> BlockSet:
        """The k best blocks (fewer if the stream has fewer), counter ascending along dim 1."""
        batch, device = self.log_z.shape[0], self.log_z.device
        if not self._seen:
            return BlockSet(self.log_z.new_zeros((batch, 0)), torch.zeros((batch, 0), dtype=torch.int64, device=device),
                            torch.zeros((batch, 0, self.block_rows), device=device))
        tops, counters = torch.cat(self._tops, dim=1), torch.cat(self._counters)
        pos = select_topk(tops, self.k).sort(dim=1).values  # [B, c] stream positions, counter ascending
        keys, order = torch.sort(torch.cat(self._keys))
        want = torch.arange(batch, device=device)[:, None] * _KEY_SHIFT + pos
        at = torch.searchsorted(keys, want.reshape(-1)).clamp(max=keys.numel() - 1)
        if not bool((keys[at] == want.reshape(-1)).all()):  # the threshold argument above
            raise RuntimeError("BlockStream: a block of the final top k was not kept")
        scores = torch.cat(self._scores)[order[at]].view(batch, pos.shape[1], self.block_rows)
        return BlockSet(tops.gather(1, pos), counters[pos], scores)


def keep_best_blocks(kept: BlockSet | None, new: BlockSet, k: int) -> BlockSet:
    """The k best blocks of ``kept`` and ``new`` by (T desc, counter asc), re-sorted by counter.

    The simple reference for :class:`BlockStream` (it copies every kept block at every
    call). Every counter in ``new`` must exceed every counter in ``kept`` (blocks come in
    row order), so concatenation keeps counters ascending and ``select_topk``'s
    lower-position tie rule is the lower-counter rule.
    """
    both = new if kept is None else BlockSet(*(torch.cat([a, b], dim=1) for a, b in zip(kept, new)))
    if both.top.shape[1] <= k:
        return both
    pos = select_topk(both.top, k).sort(dim=1).values  # [B, k] positions, counter ascending
    return BlockSet(both.top.gather(1, pos), both.counters.gather(1, pos),
                    both.scores.gather(1, pos[:, :, None].expand(-1, -1, both.scores.shape[2])))


def block_rows_of(counters: Tensor, block_rows: int) -> Tensor:
    """Global rows [B, c, b] of the grid blocks holding the pieces with ``counters`` [B, c] (-1 = an
    empty slot: rows 0..b-1, whose scores are -inf)."""
    starts = torch.where(counters >= 0, counters // block_rows * block_rows, 0)
    return starts[:, :, None] + torch.arange(block_rows, device=counters.device)


def rows_from_blocks(kept: BlockSet, k: int, seed: int, query_keys: Tensor, log_z: Tensor,
                     version: int = 0, noise=None, filter_rows: bool = True) -> ShardResult:
    """Top k rows of the kept blocks, each key drawn given its block's maximum (eq. 23).

    Returns a ShardResult [B, k] like ``gumbel_topk_dense``'s: ids global rows, scores float32,
    keys float64, ``log_z`` as given; noise is drawn for c x b rows per query only. ``noise``:
    the function drawing it (None: ``gumbel_noise``; or the fused kernel's); ``filter_rows``: take
    eq. 23's logs only for rows that can make the top k and rank only those (:func:`near_rows`,
    fewer transcendentals and a top-k over ~k rows instead of c x b, one host round trip) or
    for every row (:func:`truncated_gumbel`, a fixed dozen elementwise kernels: the GPU's choice).
    Both give the same answer.
    """
    batch, c, b = kept.scores.shape
    rows = block_rows_of(kept.counters, b).reshape(batch, c * b)
    # phi = s + G, written over the fresh noise (s.double() + G, the same sums)
    phi = (noise or gumbel_noise)(seed, query_keys, rows).view(batch, c, b).add_(kept.scores)
    phi.masked_fill_(kept.scores == NEG_INF, NEG_INF)
    scores = kept.scores.reshape(batch, c * b)
    if not filter_rows or c < k:
        keys = truncated_gumbel(phi, kept.top).reshape(batch, c * b)
        return result_from_keys(keys, scores, rows, k, log_z=log_z, version=version)
    near, z = near_rows(phi, kept.top, k)
    qb, pos = near.view(batch, c * b).nonzero(as_tuple=True)  # by query, then position
    keys = truncate(phi.view(batch, c * b)[qb, pos], z[qb, pos // b], kept.top[qb, pos // b])
    # each query's near rows packed left in position order (-inf after them): the ranking of
    # result_from_keys over all c x b keys, whose other keys are -inf, ties to the lower position
    counts = torch.bincount(qb, minlength=batch)
    col = torch.arange(qb.numel(), device=qb.device) - (counts.cumsum(0) - counts)[qb]
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    packed = torch.full((batch, width), NEG_INF, dtype=torch.float64, device=phi.device)
    packed[qb, col] = keys
    at = torch.zeros((batch, width), dtype=torch.int64, device=phi.device)
    at[qb, col] = pos
    return result_from_keys(packed, scores.gather(1, at), rows.gather(1, at), k, log_z=log_z, version=version)


def near_rows(phi: Tensor, top: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(bool [B, c, b] the rows whose eq. 23 key can reach the top k, Z [B, c] each block's max of
    phi): the rows :func:`truncated_keys` computes (its docstring says why), found in one pass.

    A row is kept when phi >= phi* (less the margin) or phi == Z, and phi > -inf; as phi <= Z,
    that is phi >= min(phi*, Z), and the floor -DBL_MAX drops the -inf rows when that bound is
    -inf (a dead block). fmin: a NaN phi* (none arises) would leave the argmax rule, as before.
    """
    a = torch.topk(top, k, dim=1).values[:, k - 1:k]  # [B, 1] the k-th best block maximum
    z = phi.amax(dim=-1)
    live = (top > NEG_INF) & (a > NEG_INF)
    inner = -torch.expm1((a - top).masked_fill(~live, 0.0)) + torch.exp((a - z).masked_fill(~live, 0.0))
    star = torch.where(live, a - torch.log(inner), torch.full_like(top, NEG_INF))
    star = star - 1e-9 * (1.0 + star.abs().nan_to_num(0.0, 0.0, 0.0))
    bound = torch.fmin(star, z).clamp_(min=-torch.finfo(phi.dtype).max)
    return phi >= bound[..., None], z


def truncated_keys(phi: Tensor, top: Tensor, k: int) -> Tensor:
    """:func:`truncated_gumbel` for the rows that can make the top k, -inf for the others.

    phi: [B, c, b] float64 unconditioned keys; top: [B, c] the blocks' maxima T. The k best
    block maxima are keys of k distinct rows, so the k-th largest key overall is at least
    a = the k-th largest T, and a row whose key is below a is never picked. The key is
    increasing in phi, so key_i >= a <=> phi_i >= phi* = a - log(1 - e^(a-T) + e^(a-Z)); rows
    above phi* less a margin (1e-9 relative, far above float64 rounding here), and each
    block's argmax row (key = T), get their exact key (:func:`near_rows`). The answer equals the
    unfiltered one, exact ties at a included; the transcendental work drops from c x b rows to
    about k.
    """
    batch, c, b = phi.shape
    if c < k:
        return truncated_gumbel(phi, top)
    near, z = near_rows(phi, top, k)
    qb, jb, rb = near.nonzero(as_tuple=True)
    out = torch.full_like(phi, NEG_INF)
    out[qb, jb, rb] = truncate(phi[qb, jb, rb], z[qb, jb], top[qb, jb])
    return out


def grid_view(scores: Tensor, row_start: int, block_rows: int) -> tuple[Tensor, Tensor]:
    """Scores [B, n] of global rows [row_start, row_start+n) in block-grid layout.

    Returns (blocks [B, nb, b] with -inf outside the rows, counters [nb] int64: the first
    row of [row_start, row_start+n) in each block).
    """
    batch, n = scores.shape
    first = row_start // block_rows * block_rows
    nb = -(-(row_start + n - first) // block_rows) if n else 0
    padded = scores.new_full((batch, nb * block_rows), NEG_INF)
    padded[:, row_start - first:row_start - first + n] = scores
    starts = first + block_rows * torch.arange(nb, device=scores.device)
    return padded.view(batch, nb, block_rows), starts.clamp(min=row_start)


def gumbel_topk_block(scores: Tensor, k: int, gold: Tensor | None, seed: int, query_keys: Tensor,
                      block_rows: int, row_start: int = 0, version: int = 0) -> ShardResult:
    """Flat block sampler: k rows of scores [B, n] (global rows [row_start, row_start+n))
    without replacement proportional to exp(s), gold excluded, drawn top-down (module docstring).

    gold: [B] or [B, e] int64 global rows (-1 = none); query_keys: [B] int64. Same law and
    ``log_z`` (float64 [B], gold-excluded logsumexp) as ``negatives.gumbel_topk_dense``; equal
    bit for bit to ``index.exact.exact_search(..., sampler="block")`` over any shards starting on
    the grid of ``block_rows``.
    """
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    masked = mask_gold(scores.float(), gold, row_start)
    blocks, counters = grid_view(masked, row_start, block_rows)
    stream = BlockStream(k, seed, query_keys, block_rows)
    if counters.numel():
        stream.add(blocks, block_log_mass(blocks), counters)
    return rows_from_blocks(stream.finish(), k, seed, query_keys, stream.log_z, version)
