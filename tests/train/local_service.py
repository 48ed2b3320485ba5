"""The NegativeService's face over ONE in-process EntityShard, so a training Worker runs in the
test's own process without Ray (tests/train/test_learning.py).

Only the transport is replaced: encoding, the index, top-k and the Gumbel-top-k draws are the
real shard's (dist_nce.actors.shard.EntityShard is plain Python; Ray only wraps it into an
actor), and the samplers finish each draw as they do behind NegativeService. Every call is
answered at once, in the caller's thread. Only what a worker with a frozen entity encoder asks
for is offered (no refreshes during training; a KB delta when the test calls :meth:`LocalService.apply_delta`,
and serving an older version again, as a resumed worker asks): anything else fails loudly.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.shard import EntityShard
from dist_nce.index.encode import state_fingerprint
from dist_nce.modeling.retriever import RetrieverConfig
from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.live_rows import LiveRows
from dist_nce.sampling.samplers import GumbelDraw, MineResult, Pending, Sampler
from dist_nce.sampling.topk import ShardResult, merge_results


class Done:
    """A Pending whose value is already there."""

    def __init__(self, value: Any):
        self.value = value

    def ready(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class LocalService:
    """One shard over every row of ``store_dir``, serving version 0 encoded from ``entity_state``."""

    kb_version = 0
    num_shards = 1

    def __init__(self, store_dir: str, retriever: RetrieverConfig, config: ServiceConfig, shard_root: str,
                 entity_state: dict):
        from kb.store import EntityStore

        self.store_dir, self.entity_state = store_dir, entity_state
        # the rows of KB version 0, as NegativeService splits them; a delta's rows are pieces added to the shard
        self.num_entities = int(EntityStore(store_dir, kb_version=0).num_entities)
        self.ranges = [(0, self.num_entities)]
        self.live = LiveRows.full(self.num_entities)
        dim = int(entity_state["transformer_config"]["hidden_size"])
        self.shard = EntityShard(store_dir, self.ranges[0], 0, 1, retriever, config, shard_root, dim)
        if self.shard.status()["served"] < 0:  # else a rerun's shard: it serves its newest persisted version
            self.shard.refresh(entity_state, 0, state_fingerprint(entity_state))
        self.sync_kb()

    def version(self) -> int:
        return int(self.shard.status()["served"])

    def status(self) -> list[dict]:
        return [self.shard.status()]

    def sync_kb(self, kb_version: int | None = None) -> int:
        """As NegativeService.sync_kb: follow the KB version the shard serves (its live rows), or ``kb_version``
        where it is not above it."""
        import torch

        from kb.store import EntityStore

        served = self.shard.status()["kb_version"]
        kb_version = served if kb_version is None or served is None else min(int(kb_version), served)
        if kb_version is not None and kb_version != self.kb_version:
            store = EntityStore(self.store_dir, kb_version=kb_version)
            self.live = LiveRows(store.num_entities, torch.as_tensor(store.tombstones, dtype=torch.int64))
            self.num_entities, self.kb_version = store.num_entities, kb_version
        return self.kb_version

    def use_version(self, version: int) -> bool:
        if int(version) not in self.shard.lineage():
            return False
        self.shard.use_version(int(version))
        return True

    def apply_delta(self, kb_version: int | None = None, entity_state: Any = None) -> int:
        """The store's current KB version (or ``kb_version``) as the next version: its added rows on the one
        shard, encoded with the weights it serves (the frozen ones it was built with). Returns the version."""
        from kb.store import EntityStore

        store = EntityStore(self.store_dir) if kb_version is None else EntityStore(self.store_dir,
                                                                                   kb_version=kb_version)
        version = max(self.shard.lineage()) + 1
        state = self.entity_state if entity_state is None else entity_state
        self.shard.apply_delta(state, version, store.kb_version, [(self.num_entities, store.num_entities)])
        return version

    def draw(self, sampler: Sampler, mention_reps: Reps | Tensor, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]:
        reps = mention_reps if isinstance(mention_reps, Reps) else Reps(mention_reps)
        reps = Reps(reps.vecs.detach().cpu(), None if reps.mask is None else reps.mask.detach().cpu())
        return sampler.draw(self, reps, gold.cpu(), int(seed), query_keys.cpu())

    def gumbel(self, reps: Reps, k: int, gold: Tensor, seed: int, query_keys: Tensor,
               pool: Tensor | None = None) -> Pending[GumbelDraw]:
        if pool is None:
            return Done(GumbelDraw(merge_results([self.shard.gumbel_topk(reps, k, gold, seed, query_keys)], k), None))
        scored = self.shard.gumbel_topk_scored(reps, k, gold, seed, query_keys, pool)
        return Done(GumbelDraw(merge_results([scored.sample], k), scored.row_scores))

    def topk(self, mention_reps: Reps | Tensor, k: int, gold: Tensor | None = None) -> Pending[ShardResult]:
        reps = mention_reps if isinstance(mention_reps, Reps) else Reps(mention_reps)
        return Done(merge_results([self.shard.topk(reps, k, gold)], k))
