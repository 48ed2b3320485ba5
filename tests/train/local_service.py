"""The NegativeService's face over ONE in-process EntityShard, so a training Worker runs in the
test's own process without Ray (tests/train/test_learning.py).

Only the transport is replaced: encoding, the index, top-k and the Gumbel-top-k draws are the
real shard's (dist_nce.actors.shard.EntityShard is plain Python; Ray only wraps it into an
actor), and the samplers finish each draw as they do behind NegativeService. Every call is
answered at once, in the caller's thread. Only what a worker with a frozen entity encoder asks
for is offered (no refreshes during training, no KB deltas): anything else fails loudly.
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

        self.num_entities = int(EntityStore(store_dir).manifest["entities"]["count"])
        self.ranges = [(0, self.num_entities)]
        self.live = LiveRows.full(self.num_entities)
        dim = int(entity_state["transformer_config"]["hidden_size"])
        self.shard = EntityShard(store_dir, self.ranges[0], 0, 1, retriever, config, shard_root, dim)
        self.shard.refresh(entity_state, 0, state_fingerprint(entity_state))

    def version(self) -> int:
        return max(self.shard.lineage(), default=-1)  # only version 0 is ever encoded

    def sync_kb(self) -> int:
        return self.kb_version

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
