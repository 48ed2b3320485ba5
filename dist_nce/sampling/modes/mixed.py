"""``mixed``: mixed-p, ``negatives.num_hard(p, K-1)`` hard negatives and the rest uniform.

The uniform part comes from a pool of K-1 uniform live rows drawn in the caller BEFORE the
source answers and sent with the Gumbel query, so the source scores the pool from the same
index version as its sample (no second round trip, no version a refresh may have retired in
between). log_q is the per-draw MIXTURE proposal (``negatives.mixed_from_pool``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from dist_nce.sampling.live_rows import mixed_from_pool_live, random_pool_live
from dist_nce.sampling.modes.hard import Hard
from dist_nce.sampling.modes.uniform import Random
from dist_nce.sampling.negatives import num_hard
from dist_nce.sampling.samplers import GumbelDraw, MineResult, Pending, SampleSource, Then, register


@register
@dataclass(frozen=True)
class Mixed:
    mode: ClassVar[str] = "mixed"
    num_negatives: int
    p: float = 50.0

    def __post_init__(self) -> None:
        num_hard(self.p, self.num_negatives)  # raises for p outside [0, 100]

    n_hard = property(lambda self: num_hard(self.p, self.num_negatives))
    n_random = property(lambda self: self.num_negatives - self.n_hard)
    p_mixed = property(lambda self: float(self.p))

    def draw(self, source: SampleSource, reps: Any, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]:
        total, n_hard, live = self.num_negatives, self.n_hard, source.live
        if n_hard in (0, total):  # p rounds to one component: draw it alone (no pool, no search)
            return (Hard if n_hard else Random)(total).draw(source, reps, gold, seed, query_keys)
        pool = random_pool_live(live, total, gold, seed)

        def finish(drawn: GumbelDraw) -> MineResult:
            sample = drawn.sample
            p = 100 * n_hard / total  # num_hard(p, total) == n_hard exactly
            negs = mixed_from_pool_live(sample, live, total, p, gold, pool, drawn.pool_scores)
            return MineResult(negs, sample.version, sample.truncation())

        return Then(source.gumbel(reps, n_hard, gold, seed, query_keys, pool=pool), finish)
