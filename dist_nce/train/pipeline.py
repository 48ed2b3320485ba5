"""Negatives for training, requested ahead of time from the NegativeService.

Two schedules (``negatives.schedule``):

* **pipelined** (:class:`NegativePrefetcher`): after optimizer step ``t`` the worker
  encodes the mentions of batch ``t + P`` with the CURRENT mention encoder (no grad,
  eval mode) and sends them to ``service.mine``, which returns a future at once. Just
  before step ``t`` it collects batch ``t``'s future, so the shards search while the
  worker trains and the only blocking ``result()`` sits between steps. Batch t is thus
  mined with the weights after step t - P, P - 1 updates older than the weights it
  trains (P = 0: synchronous mining; P = 1 leaves nothing to overlap with; P = 2 overlaps
  one whole step).
* **per_epoch** (:func:`mine_epoch`, the paper's mode): at each epoch start all of the
  worker's mentions for the epoch are encoded and mined in batched requests, and the
  epoch trains on them.

Both measure the time actually spent blocked on the service (``wait_s``), which is the
number prefetching is meant to drive to zero.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch import Tensor

from dist_nce.actors.protocols import NegativeSource
from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.negatives import Negatives
from dist_nce.sampling.samplers import Sampler
from dist_nce.train.batches import trimmed

Encode = Callable[[np.ndarray], Reps]


class StepRequest(NamedTuple):
    """What is mined for one worker's batch at one global step."""

    step: int
    mentions: np.ndarray  # [b] mention indices of the split
    gold: Tensor  # [b] int64 gold entity rows
    query_keys: Tensor  # [b] int64 Gumbel-noise keys (sampling.keys.query_keys)
    seed: int  # sampling.keys.request_seed


class Mined(NamedTuple):
    """Negatives of a batch and the index version they came from (duck-types MineResult)."""

    negatives: Negatives
    version: int


def mention_encoder(module: torch.nn.Module, tokens: Callable[[np.ndarray], np.ndarray], lengths: np.ndarray,
                    device: torch.device | str = "cpu") -> Encode:
    """A function: mention indices [b] -> mention Reps (CPU float32) from ``module``'s current weights.

    Runs in eval mode (no dropout: the proposal should be the model's own score) under
    no_grad, and restores the module's mode afterwards.
    """

    @torch.no_grad()
    def encode(idx: np.ndarray) -> Reps:
        was_training = module.training
        module.eval()
        try:
            ids, mask = trimmed(tokens(idx), lengths[idx])
            reps = module.encode_mentions(ids.to(device), mask.to(device))
        finally:
            module.train(was_training)
        return Reps(reps.vecs.float().cpu(), None if reps.mask is None else reps.mask.cpu())

    return encode


class StepNegatives(NamedTuple):
    """One worker's mined negatives for consecutive steps ``first_step, first_step + 1, ...``:
    what the prefetcher holds for the steps after a checkpoint.

    ids, log_q, hard: [P, b, K-1]; version: [P] the index version of each step's negatives.
    """

    first_step: int
    ids: Tensor
    log_q: Tensor
    hard: Tensor
    version: Tensor

    @property
    def steps(self) -> range:
        return range(self.first_step, self.first_step + len(self.version))

    def step(self, t: int) -> Mined:
        i = t - self.first_step
        return Mined(Negatives(self.ids[i], self.log_q[i], self.hard[i]), int(self.version[i]))

    def tensors(self) -> dict[str, Tensor]:
        return {"ids": self.ids, "log_q": self.log_q, "hard": self.hard, "version": self.version,
                "first_step": torch.tensor([self.first_step], dtype=torch.int64)}

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor]) -> "StepNegatives":
        return cls(int(t["first_step"][0]), t["ids"], t["log_q"], t["hard"].bool(), t["version"])


class _Ready(NamedTuple):
    """A future whose value is already known (negatives restored from a checkpoint)."""

    value: Mined

    def result(self, timeout: float | None = None) -> Mined:
        return self.value


class NegativePrefetcher:
    """Keeps ``depth`` mining requests in flight ahead of the step being trained.

    ``get(t)`` returns step t's request, its mined negatives and the seconds spent blocked;
    ``advance(t)`` (after the optimizer step of t) submits the next request with the
    updated weights; ``reset(t)`` drops what is in flight (a sync refresh wants the new index).

    ``in_flight_negatives()`` (for a checkpoint after step t: steps t+1 .. t+P) and
    ``start(t + 1, restored)`` make a restarted run train on exactly the negatives the
    uninterrupted run would have: they were mined with the weights of steps before the
    checkpoint, which the checkpoint does not hold.
    """

    def __init__(self, service: NegativeSource, sampling: Sampler, encode: Encode,
                 request: Callable[[int], StepRequest], end_step: int, depth: int,
                 clock: Callable[[], float] = time.perf_counter):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.service, self.sampling, self.encode, self.request = service, sampling, encode, request
        self.end_step, self.depth, self.clock = end_step, depth, clock
        self._pending: deque[tuple[StepRequest, Any]] = deque()
        self._next = 0
        self.submit_s = 0.0  # time spent encoding + submitting (on the worker, not waiting)
        # Of submit_s, the mention encode: on a GPU it includes waiting for the step's queued work (its
        # read-back to the host), so the rest of submit_s is the request and the Ray calls alone.
        self.encode_s = 0.0

    def start(self, step: int, restored: StepNegatives | None = None) -> None:
        self._pending.clear()
        self._next = step
        if restored is not None and restored.first_step == step:
            for t in restored.steps:
                if t < self.end_step:
                    self._pending.append((self.request(t), _Ready(restored.step(t))))
                    self._next = t + 1
        self._fill(step)

    def reset(self, step: int) -> None:
        self.start(step)

    def in_flight_negatives(self) -> StepNegatives | None:
        """The negatives of every step in flight (waits for them), or None if there are none."""
        if not self._pending:
            return None
        mined = [future.result() for _, future in self._pending]
        return StepNegatives(
            self._pending[0][0].step, torch.stack([m.negatives.ids for m in mined]),
            torch.stack([m.negatives.log_q for m in mined]), torch.stack([m.negatives.hard for m in mined]),
            torch.tensor([m.version for m in mined], dtype=torch.int64))

    def _submit(self, step: int) -> None:
        t0 = self.clock()
        req = self.request(step)
        if req.step != step:
            raise AssertionError(f"request for step {step} says step {req.step}")
        t1 = self.clock()
        reps = self.encode(req.mentions)
        self.encode_s += self.clock() - t1
        future = self.service.draw(self.sampling, reps, req.gold, req.seed, req.query_keys)
        self._pending.append((req, future))
        self.submit_s += self.clock() - t0

    def _fill(self, current: int) -> None:
        while self._next < min(current + self.depth, self.end_step):
            self._submit(self._next)
            self._next += 1

    def in_flight(self) -> list[int]:
        return [req.step for req, _ in self._pending]

    def get(self, step: int) -> tuple[StepRequest, Any, float]:
        if not self._pending:  # depth 0: synchronous mining
            self._submit(step)
            self._next = step + 1
        req, future = self._pending.popleft()
        if req.step != step:
            raise AssertionError(f"prefetcher out of order: asked for step {step}, next in flight is {req.step}")
        t0 = self.clock()
        result = future.result()
        return req, result, self.clock() - t0

    def advance(self, step_done: int) -> None:
        self._fill(step_done + 1)


def _cat_negatives(parts: list[Negatives]) -> Negatives:
    return Negatives(*(torch.cat([getattr(p, f) for p in parts]) for f in Negatives._fields))


class EpochNegatives(NamedTuple):
    """One worker's negatives for every step of an epoch (paper's per-epoch mining).

    ids, log_q, hard: [S, b, K-1]; version: [S] the oldest index version in each step's batch;
    epoch: the epoch they were mined for.
    """

    ids: Tensor
    log_q: Tensor
    hard: Tensor
    version: Tensor
    epoch: int = -1

    def step(self, i: int) -> Mined:
        return Mined(Negatives(self.ids[i], self.log_q[i], self.hard[i]), int(self.version[i]))

    def tensors(self) -> dict[str, Tensor]:
        return {"ids": self.ids, "log_q": self.log_q, "hard": self.hard, "version": self.version,
                "epoch": torch.tensor([self.epoch], dtype=torch.int64)}

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor]) -> "EpochNegatives":
        return cls(t["ids"], t["log_q"], t["hard"].bool(), t["version"], int(t["epoch"][0]))


def mine_epoch(service: NegativeSource, sampling: Sampler, encode: Encode, mentions: np.ndarray,
               gold: Callable[[np.ndarray], Tensor], keys: Callable[[np.ndarray], Tensor],
               seed: Callable[[int], int], request_size: int,
               max_in_flight: int = 2, progress: Callable[[int], None] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> tuple[EpochNegatives, float]:
    """Mine the negatives of ``mentions`` [S, b] (one row per step) in requests of ``request_size``.

    ``gold(idx)`` / ``keys(idx)`` give gold rows and Gumbel keys of mention indices, ``seed(c)``
    the seed of request c. Encoding request c+1 overlaps the search of request c. Returns
    the negatives and the seconds spent blocked on the service.
    """
    steps, b = mentions.shape
    flat = mentions.reshape(-1)
    chunks = [flat[a:a + request_size] for a in range(0, len(flat), request_size)]
    pending: deque[Any] = deque()
    parts: list[Negatives] = []
    versions: list[Tensor] = []
    wait = 0.0

    def collect() -> None:
        nonlocal wait
        n, fut = pending.popleft()
        t0 = clock()
        res = fut.result()
        wait += clock() - t0
        parts.append(res.negatives)
        versions.append(torch.full((n,), int(res.version), dtype=torch.int64))
        if progress:
            progress(n)

    for c, idx in enumerate(chunks):
        future = service.draw(sampling, encode(idx), gold(idx), seed(c), keys(idx))
        pending.append((len(idx), future))
        if len(pending) >= max_in_flight:
            collect()
    while pending:
        collect()
    neg = _cat_negatives(parts)
    k1 = neg.ids.shape[1]
    version = torch.cat(versions).view(steps, b).min(dim=1).values
    return EpochNegatives(neg.ids.view(steps, b, k1), neg.log_q.view(steps, b, k1),
                          neg.hard.view(steps, b, k1), version), wait
