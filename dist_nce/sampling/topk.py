"""Top-k selection and the cross-shard merge: small pure functions on tensors.

Every search in dist-nce, exact or approximate, plain or Gumbel-perturbed, produces a
:class:`ShardResult` per shard, and :func:`merge_results` turns S of them into the
global answer. Ordering is total and deterministic: by key descending, then by
global row id ascending, so equal keys (duplicated entities, exact ties) resolve the
same way however the rows are split into shards or chunks.

Invalid slots (fewer than k eligible rows) carry id -1 and key/score -inf.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

NEG_INF = float("-inf")


class ShardResult(NamedTuple):
    """One shard's (or the merged) answer for a batch of B queries.

    ids:    [B, k] int64 global entity rows, best first; -1 marks an empty slot.
    scores: [B, k] float32 s(x, y) of those rows (-inf in empty slots).
    keys:   [B, k] float64 the ranking keys: the scores for top-k, s + Gumbel noise for
            Gumbel-top-k (-inf in empty slots).
    log_z:  [B] float64 logsumexp of the gold-excluded scores over the rows the result was
            drawn from (all of the shard's rows for exact search; the retrieved candidates
            for candidate-mode search), or None when the backend did not compute it.
    tail_log_z: [B] float64 an ESTIMATE of logsumexp of the gold-excluded scores of the rows
            NOT covered by ``log_z`` (candidate mode), or None when ``log_z`` is exact.
    version: index version the answer came from (merged: the oldest one).
    """

    ids: Tensor
    scores: Tensor
    keys: Tensor
    log_z: Tensor | None = None
    tail_log_z: Tensor | None = None
    version: int = 0

    def truncation(self) -> Tensor | None:
        """[B] estimated softmax mass outside the rows sampled from (None if exact)."""
        if self.tail_log_z is None or self.log_z is None:
            return None
        return torch.exp(self.tail_log_z - torch.logaddexp(self.log_z, self.tail_log_z))


def _order(keys: Tensor, ids: Tensor) -> Tensor:
    """[B, n] permutation sorting by key descending, ties by id ascending (ids -1 last)."""
    # Stable two-pass sort: the second pass keeps the first pass's id order among equal keys.
    id_key = torch.where(ids < 0, torch.iinfo(torch.int64).max, ids)
    by_id = torch.sort(id_key, dim=1, stable=True).indices
    by_key = torch.sort(keys.gather(1, by_id), dim=1, descending=True, stable=True).indices
    return by_id.gather(1, by_key)


def select_topk(keys: Tensor, k: int) -> Tensor:
    """Positions [B, min(k, n)] of the k largest keys per row of ``keys`` [B, n], best first.

    Exact ties, including a tie across the k-th place, go to the lower position, so that a
    caller whose positions increase with row id gets the lower-id rule of :func:`merge_results`.
    """
    n = keys.shape[1]
    kk = min(k, n)
    if kk == 0:
        return keys.new_zeros((keys.shape[0], 0), dtype=torch.int64)
    if kk == n:
        pos = torch.arange(n, device=keys.device).expand(keys.shape[0], n)
        return pos.gather(1, _order(keys, pos))
    # One extra place reveals a tie across the k-th place, where torch.topk picks
    # arbitrarily; only such rows are redone exactly.
    vals, pos = torch.topk(keys, kk + 1, dim=1, sorted=True)
    pos, kth = pos[:, :kk], vals[:, kk - 1:kk]
    tied = vals[:, kk] == vals[:, kk - 1]
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        sub, t = keys[rows], kth[rows]
        above, equal = sub > t, sub == t
        need = kk - above.sum(dim=1, keepdim=True)
        take = above | (equal & (equal.cumsum(dim=1) <= need))
        pos = pos.clone()
        pos[rows] = take.nonzero()[:, 1].view(-1, kk)
    pos = torch.sort(pos, dim=1).values
    return pos.gather(1, _order(keys.gather(1, pos), pos))


def pad_columns(x: Tensor, k: int, value: float | int) -> Tensor:
    """Right-pad [B, n] to [B, k] with ``value`` (no-op when n >= k)."""
    if x.shape[1] >= k:
        return x
    pad = x.new_full((x.shape[0], k - x.shape[1]), value)
    return torch.cat([x, pad], dim=1)


def result_from_keys(keys: Tensor, scores: Tensor, ids: Tensor, k: int, log_z: Tensor | None = None,
                     tail_log_z: Tensor | None = None, version: int = 0) -> ShardResult:
    """Keep the top k of candidates ``keys`` [B, n], ``scores`` [B, n], ``ids`` [B, n].

    Candidates with key -inf (excluded, invalid) never win a slot: they become id -1.
    ``ids`` must be increasing along each row for exact tie handling (row ranges are).
    """
    pos = select_topk(keys, k)
    top_keys = keys.gather(1, pos).double()
    empty = top_keys == NEG_INF
    top_ids = ids.gather(1, pos).masked_fill(empty, -1)
    top_scores = scores.gather(1, pos).float().masked_fill(empty, NEG_INF)
    return ShardResult(
        ids=pad_columns(top_ids, k, -1),
        scores=pad_columns(top_scores, k, NEG_INF),
        keys=pad_columns(top_keys, k, NEG_INF),
        log_z=log_z,
        tail_log_z=tail_log_z,
        version=version,
    )


def _logsumexp_or_none(parts: list[Tensor | None], fill_missing: bool) -> Tensor | None:
    present = [p for p in parts if p is not None]
    if not present or (len(present) < len(parts) and not fill_missing):
        return None
    stacked = torch.stack([p if p is not None else torch.full_like(present[0], NEG_INF) for p in parts])
    return torch.logsumexp(stacked, dim=0)


def merge_results(results: Sequence[ShardResult], k: int) -> ShardResult:
    """Global top k from per-shard (or per-chunk) results over DISJOINT row sets.

    The merged ``log_z`` is the logsumexp of the parts (None if any part lacks it); the
    merged tail estimate is the logsumexp of the parts that have one.
    """
    if not results:
        raise ValueError("merge_results: need at least one ShardResult")
    batch = {r.ids.shape[0] for r in results}
    if len(batch) != 1:
        raise ValueError(f"merge_results: results disagree on the batch size: {sorted(batch)}")
    ids = torch.cat([r.ids for r in results], dim=1)
    keys = torch.cat([r.keys for r in results], dim=1)
    scores = torch.cat([r.scores for r in results], dim=1)
    order = _order(keys, ids)[:, :k]
    return ShardResult(
        ids=pad_columns(ids.gather(1, order), k, -1),
        scores=pad_columns(scores.gather(1, order), k, NEG_INF),
        keys=pad_columns(keys.gather(1, order), k, NEG_INF),
        log_z=_logsumexp_or_none([r.log_z for r in results], fill_missing=False),
        tail_log_z=_logsumexp_or_none([r.tail_log_z for r in results], fill_missing=True),
        version=min(r.version for r in results),
    )


def first_occurrence(x: Tensor) -> Tensor:
    """bool [B, n]: True where x[b, j] differs from every x[b, i], i < j."""
    srt = torch.sort(x, dim=1, stable=True)
    first_sorted = torch.ones_like(srt.values, dtype=torch.bool)
    first_sorted[:, 1:] = srt.values[:, 1:] != srt.values[:, :-1]
    return torch.zeros_like(first_sorted).scatter(1, srt.indices, first_sorted)


def isin_rows(x: Tensor, sets: Tensor) -> Tensor:
    """bool [B, n]: x[b, j] in sets[b, :] (``sets`` [B, e]; -1 entries never match)."""
    if sets.shape[1] == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    srt = torch.sort(sets, dim=1).values
    pos = torch.searchsorted(srt, x.contiguous()).clamp(max=srt.shape[1] - 1)
    return (srt.gather(1, pos) == x) & (x >= 0)


def as_gold(gold: Tensor, batch: int | None = None) -> Tensor:
    """gold [B] or [B, e] int64 (-1 = none) -> [B, e]."""
    if gold.dtype != torch.int64 or gold.dim() not in (1, 2):
        raise ValueError(f"gold must be int64 [B] or [B, e], got {gold.dtype} {list(gold.shape)}")
    gold = gold[:, None] if gold.dim() == 1 else gold
    if batch is not None and gold.shape[0] != batch:
        raise ValueError(f"gold has {gold.shape[0]} rows, expected B={batch}")
    return gold


def mask_gold(scores: Tensor, gold: Tensor | None, row_start: int = 0) -> Tensor:
    """A copy of scores [B, n] (global rows [row_start, row_start+n)), at least float32, with
    the gold rows (gold [B] or [B, e] int64, -1 = none; outside the range: ignored) at -inf."""
    return mask_gold_(scores.to(torch.promote_types(scores.dtype, torch.float32), copy=True), gold, row_start)


def mask_gold_(scores: Tensor, gold: Tensor | None, row_start: int = 0) -> Tensor:
    """:func:`mask_gold` in place on scores [B, n] (no copy of the score matrix); returns it."""
    batch, n = scores.shape
    if gold is not None:
        gold = as_gold(gold, batch)
        local = gold - row_start
        hit = (local >= 0) & (local < n)
        b = torch.arange(batch, device=scores.device)[:, None].expand_as(local)
        scores[b[hit], local[hit]] = float("-inf")
    return scores
