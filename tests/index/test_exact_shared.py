"""Repeated queries in one request (the bias monitor's draws) are scored once: the draws equal
those of the same request scored row by row, on the dense and block samplers, dual and SOM."""
from __future__ import annotations

import pytest
import torch

from dist_nce.index import exact
from dist_nce.index.exact import exact_search, shared_queries
from dist_nce.modeling.scoring import Reps, ScoreSpec


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_shared_queries_maps_every_row_to_its_distinct_row():
    v = torch.randn(3, 4, 2, generator=gen(0))
    mask = torch.tensor([[True, True, False, False], [True] * 4, [True, False, True, False]])
    rows = torch.tensor([0, 1, 0, 2, 1, 0])
    q = Reps(v[rows], mask[rows])
    distinct, inverse = shared_queries(q)
    assert distinct.vecs.shape[0] == 3 and inverse.shape == (6,)
    torch.testing.assert_close(distinct.vecs[inverse], q.vecs, rtol=0, atol=0)
    assert torch.equal(distinct.mask[inverse], q.mask)
    # the same vectors under another mask are another query
    other = Reps(v[[0, 0]], torch.stack([mask[0], mask[1]]))
    assert shared_queries(other)[1] is None
    assert shared_queries(Reps(torch.randn(5, 3, generator=gen(1))))[1] is None


def _replicated(preset: str) -> tuple[ScoreSpec, Reps, Reps]:
    spec = ScoreSpec.preset(preset)
    if preset == "dual":
        ents, q = Reps(torch.randn(150, 8, generator=gen(2))), Reps(torch.randn(3, 8, generator=gen(3)))
    else:
        emask = torch.rand(150, 5, generator=gen(4)) < 0.8
        emask[:, 0] = True
        ents = Reps(torch.randn(150, 5, 8, generator=gen(2)), emask)
        q = Reps(torch.randn(3, 4, 8, generator=gen(3)), torch.tensor([[True] * 4, [True] * 2 + [False] * 2,
                                                                        [True, False, True, True]]))
    rows = torch.arange(3).repeat(4)  # replicate-major, as BiasMonitor asks
    return spec, ents, Reps(q.vecs[rows], None if q.mask is None else q.mask[rows])


@pytest.mark.parametrize("preset", ["dual", "som"])
@pytest.mark.parametrize("sampler", ["dense", "block"])
def test_draws_of_repeated_queries_equal_the_unshared_ones(preset, sampler, monkeypatch):
    spec, ents, q = _replicated(preset)
    gold = torch.tensor([7, 140, -1]).repeat(4)
    keys = torch.arange(12) + 1000 * torch.arange(12) // 3
    args = dict(k=9, gold=gold, chunk_rows=40, seed=11, query_keys=keys, sampler=sampler, block_rows=8,
                kernel="torch")
    calls = []
    real = exact.score_all
    monkeypatch.setattr(exact, "score_all", lambda s, m, e: calls.append(m.vecs.shape[0]) or real(s, m, e))
    shared = exact_search(spec, q, ents, 0, **args)
    assert set(calls) == {3}  # every chunk scored the 3 distinct queries, not the 12 rows
    calls.clear()
    alone = exact_search(spec, q, ents, 0, **args, share_queries=False)
    assert set(calls) == {12}
    assert torch.equal(shared.ids, alone.ids)
    torch.testing.assert_close(shared.keys, alone.keys, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shared.log_z, alone.log_z, rtol=1e-6, atol=1e-6)
    # the replicates are different draws (their own keys), not copies of one
    per = shared.ids.view(4, 3, -1)
    assert not all(torch.equal(per[0, i], per[r, i]) for r in range(1, 4) for i in range(3))
