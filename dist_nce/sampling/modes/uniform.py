"""``random``: K-1 negatives uniform over the live rows, without the gold and without duplicates.

Drawn in the caller from the source's row space alone: no search, version -1. log_q is
``-log(live rows - excluded rows)`` (``negatives.sample_random``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from dist_nce.sampling.live_rows import sample_random_live
from dist_nce.sampling.samplers import Done, MineResult, Pending, SampleSource, register


@register
@dataclass(frozen=True)
class Random:
    mode: ClassVar[str] = "random"
    num_negatives: int
    p: float = 0.0  # unused: every mode takes (K-1, p)

    n_hard = property(lambda self: 0)
    n_random = property(lambda self: self.num_negatives)
    p_mixed = property(lambda self: None)

    def draw(self, source: SampleSource, reps: Any, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]:
        return Done(MineResult(sample_random_live(source.live, self.num_negatives, gold, seed), -1, None))
