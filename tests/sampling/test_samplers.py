"""The sampler seam: the registry, the config literal, and every mode against the flat reference."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from dist_nce.sampling import modes, negatives as ng, samplers
from dist_nce.sampling.live_rows import LiveRows
from dist_nce.sampling.modes import sampler_for, sampler_for_split
from dist_nce.sampling.samplers import Done, FlatScores, MineResult, Pending, SampleSource, Sampler, Then
from dist_nce.train.config import NegativesConfig

N, B, K1, SEED = 300, 6, 9, 1234


def scores_and_gold():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(B, N, generator=gen) * 2
    gold = torch.randint(0, N, (B,), generator=gen)
    return scores, gold, torch.arange(B, dtype=torch.int64) * 7


def same(a: ng.Negatives, b: ng.Negatives) -> None:
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.log_q, b.log_q)
    assert torch.equal(a.hard, b.hard)


def test_registry_is_the_config_literal():
    """The modes a config may name are exactly the registered ones: adding a mode file without
    its literal (or the reverse) fails here."""
    literal = typing.get_args(typing.get_type_hints(NegativesConfig)["mode"])
    assert sorted(literal) == modes.modes()
    assert {"hard", "mixed", "random"} <= set(modes.modes())  # the paper's three
    with pytest.raises(ValueError, match=r"negatives.mode: expected one of \[.*'hard', 'mixed', 'random'.*\]"):
        sampler_for("hardest", K1)
    with pytest.raises(ValueError, match="at least one negative"):
        sampler_for("hard", 0)
    with pytest.raises(ValueError, match="p must be in"):
        sampler_for("mixed", K1, 101)


@pytest.mark.parametrize("mode", ["random", "hard", "mixed"])
def test_every_mode_is_a_sampler_and_the_service_is_a_source(mode):
    s = sampler_for(mode, K1, 50)
    assert isinstance(s, Sampler) and s.mode == mode
    assert s.n_hard + s.n_random == s.num_negatives == K1
    assert isinstance(FlatScores(torch.zeros(2, 3)), SampleSource)
    from dist_nce.actors.service import NegativeService

    for name in ("gumbel", "topk", "draw"):  # the service offers the source face (and ``live``) to every sampler
        assert callable(getattr(NegativeService, name))


def test_split_of_each_mode():
    assert (sampler_for("random", 63).n_hard, sampler_for("random", 63).n_random) == (0, 63)
    assert (sampler_for("hard", 63).n_hard, sampler_for("hard", 63).p_mixed) == (63, None)
    m = sampler_for("mixed", 63, 50)
    assert (m.n_hard, m.n_random, m.p_mixed) == (32, 31, 50.0)  # round half up, as the paper
    assert sampler_for_split(0, 5).mode == "random"
    assert sampler_for_split(5, 0).mode == "hard"
    assert (sampler_for_split(3, 2).mode, sampler_for_split(3, 2).n_hard) == ("mixed", 3)


def test_random_equals_the_uniform_reference():
    scores, gold, keys = scores_and_gold()
    got = sampler_for("random", K1).draw(FlatScores(scores), None, gold, SEED, keys).result()
    assert got.version == -1 and got.truncation is None
    same(got.negatives, ng.sample_random(N, K1, gold, SEED))


def test_hard_equals_the_dense_gumbel_reference():
    scores, gold, keys = scores_and_gold()
    got = sampler_for("hard", K1).draw(FlatScores(scores), None, gold, SEED, keys).result()
    same(got.negatives, ng.sample_hard(scores, K1, gold, SEED, keys))
    assert not bool((got.negatives.ids == gold[:, None]).any())


@pytest.mark.parametrize("p", [0, 30, 50, 100])
def test_mixed_equals_the_mixture_reference(p):
    """Mixed over a flat source draws what negatives.mixed_negatives draws from the same scores:
    the pool from the same seed, the hard part from the same Gumbel keys, the mixture proposal."""
    scores, gold, keys = scores_and_gold()
    got = sampler_for("mixed", K1, p).draw(FlatScores(scores), None, gold, SEED, keys).result()
    top = ng.gumbel_topk_dense(scores, K1, gold, SEED, keys)
    want = ng.mixed_negatives(top, N, K1, p, gold, SEED, random_scores_fn=lambda ids: scores.gather(1, ids))
    assert int(got.negatives.hard.sum(dim=1)[0]) == ng.num_hard(p, K1)
    if 0 < ng.num_hard(p, K1) < K1:
        same(got.negatives, want)
    else:  # one component only: the same ids as the mixture reference, drawn by that component alone
        assert torch.equal(got.negatives.ids, want.ids)
        assert torch.allclose(got.negatives.log_q, want.log_q)


def test_pending_answers():
    calls = []

    class Slow:
        def ready(self):
            return False

        def result(self, timeout=None):
            calls.append(timeout)
            return 20

    t = Then(Slow(), lambda v: v + 1)
    assert isinstance(t, Pending) and not t.ready()
    assert t.result(3) == 21 and t.result() == 21 and calls == [3]  # finished once, cached
    assert t.ready()
    assert Then(None, lambda v: v is None).result() is True
    assert Done(5).ready() and Done(5).result() == 5


def test_a_new_mode_is_one_class():
    """What a mode file holds: a registered class drawing through the source alone. This one keeps
    the K-1 top-scoring rows (no noise), and the flat source serves it unchanged."""

    @samplers.register
    @dataclass(frozen=True)
    class TopScores:
        mode: ClassVar[str] = "test_top_scores"
        num_negatives: int
        p: float = 0.0

        n_hard = property(lambda self: self.num_negatives)
        n_random = property(lambda self: 0)
        p_mixed = property(lambda self: None)

        def draw(self, source: SampleSource, reps: Any, gold, seed, query_keys) -> Pending[MineResult]:
            k = self.num_negatives

            def finish(top):
                negs = ng.Negatives(top.ids, torch.zeros(top.ids.shape), torch.ones(top.ids.shape, dtype=torch.bool))
                return MineResult(negs, top.version, None)

            return Then(source.topk(reps, k, gold), finish)

    try:
        scores, gold, keys = scores_and_gold()
        got = sampler_for("test_top_scores", K1).draw(FlatScores(scores), None, gold, SEED, keys).result()
        masked = scores.scatter(1, gold[:, None], float("-inf"))
        assert torch.equal(got.negatives.ids, masked.topk(K1, dim=1).indices)
    finally:
        del samplers.MODES["test_top_scores"]


def test_flat_source_serves_pool_scores_and_live_rows():
    scores, gold, keys = scores_and_gold()
    pool = torch.randint(0, N, (B, 4))
    drawn = FlatScores(scores).gumbel(None, 3, gold, SEED, keys, pool=pool).result()
    assert torch.equal(drawn.pool_scores, scores.gather(1, pool))
    live = FlatScores(scores).live
    assert isinstance(live, LiveRows) and live.num_live == live.count == N
