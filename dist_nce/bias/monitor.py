"""The live gradient-bias monitor: Theorem 1's bias of THIS run's NCE gradient, while it trains.

Every ``bias.every_steps`` steps, on a fixed probe set of training mentions (the first
``bias.probe_mentions`` eligible ones, the same for the whole run):

1. encode the probe with the current mention encoder (every rank: under ZeRO-3 a forward
   needs all ranks; only rank 0 goes on);
2. draw ``bias.draws`` candidate sets per probe mention with the run's own sampler (random,
   hard or mixed-p, through the same ``NegativeService.draw`` the trainer uses; one request,
   each replicate with its own Gumbel keys);
3. ask the shards, at the index version those sets were drawn from, for the exact
   d/dq LSE over the whole KB and d/dq LSE over each candidate set
   (``NegativeService.lse_grad``, :mod:`dist_nce.bias.gradbias`), and take
   b(x) = d LSE_KB - mean_r d LSE_{C_r} with its Monte Carlo standard error.

What it measures is the bias on the mention representation q of the gradient of eq. 7 under
the negatives this run really trains with (approximate samplers included), against the
full-softmax cross-entropy of the index's model. Cost: one scoring pass over the KB for the
probe plus probe x draws mining queries; ``bias/seconds`` is logged beside it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from dist_nce.bias.gradbias import estimate, summary
from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.keys import request_seed
from dist_nce.sampling.samplers import MineResult, Pending, Sampler

# Gumbel keys of the monitor's replicates: replicate r of probe mention i gets
# (r + 1) * KEY_STRIDE + i, apart from the training keys (epoch * mentions + index).
KEY_STRIDE = 1 << 40
# The monitor's mining seeds sit at an "epoch" no run reaches. Sharing noise with training
# would not bias anything (the monitor never changes what is trained); this keeps them apart.
MONITOR_EPOCH = 2**31 - 1


def replicate(reps: Reps, draws: int) -> Reps:
    """[P, ...] -> [draws * P, ...], replicate-major (row r * P + i is mention i, draw r)."""
    rep = (draws,) + (1,) * (reps.vecs.dim() - 1)
    mask = None if reps.mask is None else reps.mask.repeat(draws, 1)
    return Reps(reps.vecs.repeat(*rep), mask)


class BiasSource(Protocol):
    """What the monitor asks of the KB: the run's own sampler's draws, and exact log-sum-exp and
    gradient parts over all rows or over given rows (``NegativeService`` implements both)."""

    def draw(self, sampler: Sampler, mention_reps: Reps, gold: torch.Tensor, seed: int,
             query_keys: torch.Tensor) -> Pending[MineResult]: ...

    def lse_grad(self, mention_reps: Reps, rows: torch.Tensor | None = None,
                 version: int | None = None) -> Pending[Any]: ...


class BiasMonitor:
    """Measure Theorem 1's bias on ``probe`` (mention indices) with ``draws`` sets each.

    service: a :class:`BiasSource` (the NegativeService); encode: mention indices -> Reps
    (the trainer's current mention encoder); gold: int64 [P] gold rows of the probe.
    """

    def __init__(self, service: BiasSource, sampling: Sampler, encode: Callable[[np.ndarray], Reps],
                 probe: np.ndarray, gold: torch.Tensor, draws: int, seed: int):
        if draws < 2:
            raise ValueError(f"bias.draws must be >= 2 for a standard error, got {draws}")
        self.service, self.sampling, self.encode = service, sampling, encode
        self.probe, self.gold, self.draws, self.seed = np.asarray(probe), gold.long(), draws, seed

    def measure(self, step: int, rank: int = 0) -> dict[str, float] | None:
        """The bias scalars at ``step`` (rank 0), None on other ranks."""
        t0 = time.perf_counter()
        reps = self.encode(self.probe)
        if rank != 0:
            return None
        p, r, s = len(self.probe), self.draws, self.sampling
        keys = torch.as_tensor(self.probe, dtype=torch.int64).repeat(r) + \
            KEY_STRIDE * torch.arange(1, r + 1).repeat_interleave(p)
        gold = self.gold.repeat(r)
        mined = self.service.draw(s, replicate(reps, r), gold, seed=request_seed(self.seed, MONITOR_EPOCH, step, 0),
                                  query_keys=keys).result()
        sets = torch.cat([gold[:, None], mined.negatives.ids], dim=1)  # [r * P, K], gold first
        sets = sets.view(r, p, -1).transpose(0, 1).contiguous()  # [P, r, K]
        version = mined.version if mined.version >= 0 else None  # random-only mining asks no shard
        full = self.service.lse_grad(reps, version=version).result()
        cand = self.service.lse_grad(reps, rows=sets, version=full.version).result()
        out = summary(estimate(full, cand))
        out.update({"bias/version": float(full.version), "bias/seconds": time.perf_counter() - t0})
        return out
