"""Where a draw's randomness comes from: Gumbel-noise keys and request seeds (pure functions).

A mention's noise is keyed by ``query_key = epoch * num_mentions + mention index``: fresh noise
every epoch, the same noise after a restart. Each mining request's seed is a pure function of
where the request is in the run, ``(seed, epoch, step, rank)``. So a resumed run draws the same
negatives again without any sampler state in its checkpoint (docs/design.md section 5).
"""
from __future__ import annotations

import numpy as np
import torch


def query_keys(epoch: int, mention_idx: np.ndarray, split_mentions: int) -> torch.Tensor:
    """[b] int64 Gumbel-noise keys: unique per (epoch, mention), stable across restarts."""
    idx = torch.as_tensor(np.asarray(mention_idx, dtype=np.int64))
    return epoch * int(split_mentions) + idx


def request_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """A 63-bit seed per mining request, a pure function of where the request is in the run."""
    lo, hi = np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, step, rank]).generate_state(2, np.uint32)
    return (int(lo) | int(hi) << 32) >> 1
