"""A deterministic stand-in for NegativeService (unit tests only; the Ray tests use the real one)."""
from __future__ import annotations

import torch

from dist_nce.sampling.negatives import Negatives


class Future:
    def __init__(self, value, log=None, name=None):
        self.value, self.log, self.name = value, log, name

    def ready(self) -> bool:
        return True

    def result(self, timeout=None):
        if self.log is not None:
            self.log.append(("result", self.name))
        return self.value


class MineResult:
    def __init__(self, negatives, version):
        self.negatives, self.version, self.truncation = negatives, version, None


class Handle:
    def __init__(self, service, version):
        self.service, self.version, self.waited = service, version, False

    def done(self) -> bool:
        return self.waited or self.service.instant

    def wait(self, timeout=None) -> int:
        self.waited = True
        self.service.served = self.version
        return self.version


class FakeService:
    """mine() / draw(): negative k of mention b is (gold_b + 1 + k + key_b) mod N, tagged with the served version.

    Records every call in ``calls``; ``refresh`` records the state it was given.
    """

    def __init__(self, num_entities: int = 50, instant: bool = True):
        self.num_entities, self.instant = num_entities, instant
        self.served, self.calls, self.states = 0, [], []

    def version(self) -> int:
        return self.served

    def mine(self, reps, gold, n_hard, n_random, seed, query_keys, p_mixed=None):
        k1 = n_hard + n_random
        offs = torch.arange(k1)[None, :] + 1 + (query_keys[:, None] % 3)
        ids = (gold[:, None] + offs) % self.num_entities
        negs = Negatives(ids, torch.full(ids.shape, -1.0), torch.arange(k1)[None, :].expand_as(ids) < n_hard)
        self.calls.append(("mine", reps.vecs.clone(), gold.clone(), seed, query_keys.clone()))
        return Future(MineResult(negs, self.served), self.calls, len(self.calls) - 1)

    def draw(self, sampler, reps, gold, seed, query_keys):
        """The service's sampler face: the same answers as ``mine`` with the sampler's split."""
        return self.mine(reps, gold, sampler.n_hard, sampler.n_random, seed, query_keys, sampler.p_mixed)

    def refresh(self, state, version=None, wait=False, after=-1):
        """As the real service: ``version`` None is numbered past every version handed out and ``after``."""
        if version is None:
            version = max([self.served, after, *(v for _, v in self.states)]) + 1
        self.states.append((state, version))
        handle = Handle(self, version)
        if self.instant or wait:
            handle.wait()
        return handle
