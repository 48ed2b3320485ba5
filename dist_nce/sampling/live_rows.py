"""Uniform sampling over the LIVE rows of a KB after deltas (random and mixed-p negatives).

A KB delta tombstones removed rows instead of moving row ids (``kb.delta``), so the row
space ``[0, count)`` has holes. Random negatives must be uniform over the live rows minus
the gold minus the hard ones drawn, and their proposal N must count live rows only. Rather
than listing millions of live rows, :class:`LiveRows` maps between a row and its RANK among
live rows with the sorted tombstone array alone (O(removed) memory, one searchsorted), and
the samplers of :mod:`dist_nce.sampling.negatives` run unchanged in rank space.

With no tombstones ranks are rows, so every function here returns exactly what the plain
sampler returns for the same seed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dist_nce.sampling.negatives import Negatives, mixed_from_pool, sample_random
from dist_nce.sampling.topk import ShardResult


class LiveRows(NamedTuple):
    """count: rows in the row space; dead: sorted unique int64 [t] tombstoned rows (< count)."""

    count: int
    dead: Tensor

    @classmethod
    def full(cls, count: int) -> "LiveRows":
        return cls(int(count), torch.zeros(0, dtype=torch.int64))

    @property
    def num_live(self) -> int:
        return self.count - int(self.dead.numel())

    def rank(self, rows: Tensor) -> Tensor:
        """Rank among live rows of each of ``rows`` (any shape, int64); -1 for -1, dead or out-of-range rows."""
        ok = (rows >= 0) & (rows < self.count)
        if not self.dead.numel():
            return torch.where(ok, rows, -1)
        before = torch.searchsorted(self.dead, rows.contiguous())  # dead rows < row
        at = before.clamp(max=self.dead.numel() - 1)
        ok &= self.dead[at] != rows
        return torch.where(ok, rows - before, -1)

    def row(self, ranks: Tensor) -> Tensor:
        """The live row of each rank in ``[0, num_live)`` (any shape, int64); -1 stays -1."""
        if not self.dead.numel():
            return ranks
        # Live row x has rank x - #{dead < x}; with u_i = dead_i - i, row = rank + #{i: u_i <= rank}.
        shifted = self.dead - torch.arange(self.dead.numel(), dtype=torch.int64)
        rows = ranks + torch.searchsorted(shifted, ranks.contiguous(), right=True)
        return torch.where(ranks >= 0, rows, -1)


def sample_random_live(live: LiveRows, num_negatives: int, gold: Tensor, generator: int | torch.Generator,
                       exclude: Tensor | None = None) -> Negatives:
    """``negatives.sample_random`` over the live rows: uniform, no duplicates, never the gold nor
    ``exclude``; ``log_q = -log(live rows - excluded live rows)``. ids are rows."""
    negs = sample_random(live.num_live, num_negatives, live.rank(gold), generator,
                         None if exclude is None else live.rank(exclude))
    return negs._replace(ids=live.row(negs.ids))


def random_pool_live(live: LiveRows, num_negatives: int, gold: Tensor, generator: int | torch.Generator) -> Tensor:
    """``negatives.random_pool`` over the live rows: [B, K-1] distinct live non-gold rows."""
    return sample_random_live(live, num_negatives, gold, generator).ids


def mixed_from_pool_live(hard: ShardResult, live: LiveRows, num_negatives: int, p: float, gold: Tensor,
                         pool: Tensor, pool_scores: Tensor | None = None) -> Negatives:
    """``negatives.mixed_from_pool`` with the uniform part over the live rows (N = live rows)."""
    return mixed_from_pool(hard, live.num_live, num_negatives, p, live.rank(gold), pool, pool_scores)
