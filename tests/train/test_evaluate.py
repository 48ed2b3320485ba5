"""Dev evaluation: metrics, the per-rank split, and rankings gathered across ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.sampling.topk import ShardResult
from dist_nce.train.evaluate import dev_metrics, evaluate, rank_slice


def test_dev_metrics_by_hand():
    ranked = np.array([[3, 1, 2], [5, 4, 0], [7, 8, 9], [1, 2, 3]])
    gold = np.array([3, 4, 9, -1])
    m = dev_metrics(ranked, gold, [1, 2, 3])
    assert (m["recall@1"], m["recall@2"], m["recall@3"], m["accuracy"]) == (0.25, 0.5, 0.75, 0.25)
    assert (m["n_mentions"], m["n_gold_not_in_kb"]) == (4, 1)


@pytest.mark.parametrize("n,world", [(10, 3), (7, 2), (2, 4), (9, 1)])
def test_rank_slices_cover_every_mention_once_with_equal_lengths(n, world):
    indices = np.arange(100, 100 + n)
    parts = [rank_slice(indices, r, world) for r in range(world)]
    assert len({len(p) for p, _ in parts}) == 1  # same number of forwards on every rank
    assert np.array_equal(np.concatenate([p[:k] for p, k in parts]), indices)
    for p, _ in parts:
        assert len(set(p.tolist())) == len(p)  # padding never repeats a mention of the slice


class Mentions:
    def __init__(self, n: int, seed: int = 0):
        g = np.random.default_rng(seed)
        self.lengths = g.integers(3, 6, n)
        self.tokens = np.zeros((n, 6), np.int32)
        for i, length in enumerate(self.lengths):
            self.tokens[i, :length] = g.integers(1000, 2000, length)
        self.gold_rows = g.integers(0, 30, n)

    def token_ids(self, idx):
        return self.tokens[np.asarray(idx)]


class BruteForce:
    """topk over fixed entity vectors, the NegativeService way (a future with result())."""

    def __init__(self, entities: torch.Tensor):
        self.entities = entities

    def topk(self, reps, k, gold=None):
        scores = reps.vecs @ self.entities.T
        top = scores.topk(k, dim=1)
        result = ShardResult(top.indices, top.values, top.values.double(), version=7)
        return type("F", (), {"result": lambda self, timeout=None: result})()


def test_two_ranks_give_the_one_rank_answer(tiny_model_dir):
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    model = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir))
    mentions, indices = Mentions(11), np.arange(11)
    service = BruteForce(torch.randn(30, 32, generator=torch.Generator().manual_seed(1)))
    model.train()
    single = evaluate(model, mentions, indices, service, [1, 5, 10], batch_size=4)
    assert model.training and single["index_version"] == 7 and single["n_mentions"] == 11
    parts = {}
    for rank in (1, 0):  # rank 1 contributes its part; rank 0 gathers both
        parts[rank] = None

        def gather(obj, rank=rank):
            parts[rank] = obj
            return [parts.get(0), parts.get(1)]

        out = evaluate(model, mentions, indices, service, [1, 5, 10], batch_size=4, rank=rank, world=2,
                       all_gather=gather)
        assert (out is None) == (rank == 1)
    assert out == single
