"""``hard``: K-1 negatives without replacement in proportion to exp s(x, y) over the KB minus
the gold (the paper's hard negatives), drawn exactly by Gumbel-top-k in the source.

log_q = s(x, y) - log_z, the per-draw softmax proposal (``negatives.hard_negatives``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from dist_nce.sampling.negatives import hard_negatives
from dist_nce.sampling.samplers import GumbelDraw, MineResult, Pending, SampleSource, Then, register


@register
@dataclass(frozen=True)
class Hard:
    mode: ClassVar[str] = "hard"
    num_negatives: int
    p: float = 100.0  # unused: every mode takes (K-1, p)

    n_hard = property(lambda self: self.num_negatives)
    n_random = property(lambda self: 0)
    p_mixed = property(lambda self: None)

    def draw(self, source: SampleSource, reps: Any, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]:
        k = self.num_negatives

        def finish(drawn: GumbelDraw) -> MineResult:
            sample = drawn.sample
            return MineResult(hard_negatives(sample, k), sample.version, sample.truncation())

        return Then(source.gumbel(reps, k, gold, seed, query_keys), finish)
