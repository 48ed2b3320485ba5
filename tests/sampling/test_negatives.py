"""Samplers of dist_nce.sampling.negatives against exact references, with negative controls."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from dist_nce.sampling import negatives as ng
from dist_nce.sampling.block_gumbel import gumbel_topk_block
from dist_nce.sampling.topk import ShardResult, first_occurrence, isin_rows, merge_results, result_from_keys, select_topk

MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------- references


def splitmix_ref(x: int) -> int:
    """splitmix64 on Python ints (unbounded, masked): the obviously correct version."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def gumbel_ref(seed: int, qkey: int, row: int) -> float:
    q = splitmix_ref(splitmix_ref(seed & MASK64) ^ (qkey & MASK64))
    r = splitmix_ref((row & MASK64) ^ 0x5851F42D4C957F2D)
    h = splitmix_ref(q ^ r)
    u = ((h >> 11) + 0.5) * 2.0 ** -53
    return -math.log(-math.log(u))


def successive_sampling(p: list[float], k: int) -> dict[tuple[int, ...], float]:
    """Exact law of k ordered draws without replacement, each proportional to p among the rest."""
    out = {}
    for seq in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for i in seq:
            prob *= p[i] / left
            left -= p[i]
        out[seq] = prob
    return out


def inclusion_max_z(samples: torch.Tensor, pi: torch.Tensor) -> float:
    """max_i |freq(i in sample) - pi_i| / sd, the statistic the sampler tests share."""
    d = samples.shape[0]
    freq = torch.stack([(samples == i).any(dim=1).double().mean() for i in range(len(pi))])
    sd = torch.sqrt(pi * (1 - pi) / d)
    return float(((freq - pi).abs() / sd).max())


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value; cells with expected < min_expected are pooled."""
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# Both exact samplers: the dense reference, and the block sampler (sampling.block_gumbel) with
# blocks small enough that the 10 labels make 4-5 blocks (so K-1 = 3 keeps only some of them).
SAMPLERS = [pytest.param({"sampler": "dense"}, id="dense"),
            pytest.param({"sampler": "block", "block_rows": 3}, id="block3"),
            pytest.param({"sampler": "block", "block_rows": 2}, id="block2")]

# Small label space: 10 labels, label 0 is the gold, k = 3 of the 9 others.
SCORES = torch.tensor([2.5, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 0.8, -1.0, 1.2], dtype=torch.float64)
DRAWS, K = 200_000, 3


@pytest.fixture(scope="module")
def exact_law():
    p = torch.softmax(SCORES[1:], 0).tolist()  # gold (label 0) excluded
    law = successive_sampling(p, K)
    pi = torch.zeros(9, dtype=torch.float64)
    for seq, prob in law.items():
        for i in seq:
            pi[i] += prob
    return law, pi


def test_gumbel_noise_matches_python_reference():
    seeds, qkeys, rows = [0, 7, 2**62 + 5], torch.tensor([0, 1, -3, 2**40]), torch.tensor([0, 1, 999, 2**33 + 7])
    for seed in seeds:
        got = ng.gumbel_noise(seed, qkeys, rows)
        want = torch.tensor([[gumbel_ref(seed, q, r) for r in rows.tolist()] for q in qkeys.tolist()],
                            dtype=torch.float64)
        assert torch.equal(got, want)
    # per-query rows [B, n] give the same noise as shared rows [n]
    assert torch.equal(ng.gumbel_noise(3, qkeys, rows.expand(4, 4)), ng.gumbel_noise(3, qkeys, rows))


def test_gumbel_noise_moments():
    g = ng.gumbel_noise(11, torch.arange(100), torch.arange(10_000)).flatten()
    assert abs(float(g.mean()) - 0.5772156649) < 0.005
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.01
    assert torch.isfinite(g).all()


def test_gumbel_noise_rejects_bad_dtypes():
    with pytest.raises(ValueError, match="query_keys must be int64"):
        ng.gumbel_noise(0, torch.arange(3.0), torch.arange(4))
    with pytest.raises(ValueError, match="rows must be int64"):
        ng.gumbel_noise(0, torch.arange(3), torch.arange(4).int())


def _gumbel_samples(seed: int = 5, **sampler) -> torch.Tensor:
    scores = SCORES.float().expand(DRAWS, -1)
    neg = ng.sample_hard(scores, K, torch.zeros(DRAWS, dtype=torch.int64), seed, torch.arange(DRAWS), **sampler)
    return neg.ids - 1  # labels 1..9 -> 0..8


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hard_sampler_matches_exact_without_replacement_law(exact_law, sampler):
    law, pi = exact_law
    samples = _gumbel_samples(**sampler)
    assert inclusion_max_z(samples, pi) < 5.0
    # the ORDER is successive sampling too: chi-square over all 504 ordered triples
    index = {seq: j for j, seq in enumerate(law)}
    codes = torch.tensor([index[tuple(s)] for s in samples.tolist()])
    counts = torch.bincount(codes, minlength=len(law)).double()
    expected = torch.tensor(list(law.values()), dtype=torch.float64) * DRAWS
    assert chi2_pvalue(counts, expected) > 1e-4


def test_inclusion_statistic_rejects_wrong_samplers(exact_law):
    law, pi = exact_law
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(SCORES[1:], 0)
    with_replacement = torch.multinomial(p.expand(DRAWS, -1), K, replacement=True, generator=gen)
    uniform = torch.rand(DRAWS, 9, generator=gen).argsort(dim=1)[:, :K]
    # a Gumbel sampler at the wrong temperature (s / 1.1): subtly wrong, still caught
    tempered = ng.sample_hard(SCORES.float().expand(DRAWS, -1) / 1.1, K, torch.zeros(DRAWS, dtype=torch.int64),
                              5, torch.arange(DRAWS)).ids - 1
    assert inclusion_max_z(with_replacement, pi) > 20
    assert inclusion_max_z(uniform, pi) > 20
    assert inclusion_max_z(tempered, pi) > 10
    index = {seq: j for j, seq in enumerate(law)}
    counts = torch.bincount(torch.tensor([index[tuple(s)] for s in uniform.tolist()]), minlength=len(law))
    expected = torch.tensor(list(law.values()), dtype=torch.float64) * DRAWS
    assert chi2_pvalue(counts.double(), expected) < 1e-10


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hard_negatives_log_q_and_gold_exclusion(sampler):
    torch.manual_seed(0)
    scores = torch.randn(6, 40)
    gold = torch.tensor([0, 5, 39, 7, 7, 12])
    scores[torch.arange(6), gold] = 10.0  # the gold has the top score
    neg = ng.sample_hard(scores, 8, gold, seed=1, query_keys=torch.arange(6), **sampler)
    assert not (neg.ids == gold[:, None]).any()
    assert first_occurrence(neg.ids).all() and neg.hard.all()
    masked = scores.double().clone()
    masked[torch.arange(6), gold] = float("-inf")
    want = masked.gather(1, neg.ids) - torch.logsumexp(masked, 1, keepdim=True)
    torch.testing.assert_close(neg.log_q, want.float())


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hard_sampler_multiple_golds_and_determinism(sampler):
    scores = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    gold = torch.tensor([[1, 2], [3, -1], [0, 29], [5, 5]])
    a = ng.sample_hard(scores, 10, gold, seed=9, query_keys=torch.arange(4), **sampler)
    b = ng.sample_hard(scores, 10, gold, seed=9, query_keys=torch.arange(4), **sampler)
    c = ng.sample_hard(scores, 10, gold, seed=10, query_keys=torch.arange(4), **sampler)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert not isin_rows(a.ids, gold).any()


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hard_sampler_too_few_entities(sampler):
    with pytest.raises(ValueError, match="fewer than 5 eligible"):
        ng.sample_hard(torch.randn(2, 5), 5, torch.tensor([0, 1]), 0, torch.arange(2), **sampler)


@pytest.mark.parametrize("n", [40, 5000])  # dense path / rejection path
def test_random_sampler_valid_and_uniform(n):
    b, k = 4000, 6
    gold = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(2))
    exclude = torch.stack([(gold + 1) % n, torch.full_like(gold, -1)], 1)
    neg = ng.sample_random(n, k, gold, generator=3, exclude=exclude)
    assert neg.ids.shape == (b, k) and ((neg.ids >= 0) & (neg.ids < n)).all()
    assert first_occurrence(neg.ids).all()
    assert not isin_rows(neg.ids, torch.cat([gold[:, None], exclude], 1)).any()
    torch.testing.assert_close(neg.log_q, torch.full((b, k), -math.log(n - 2)))
    assert torch.equal(neg.ids, ng.sample_random(n, k, gold, 3, exclude).ids)
    # uniform: per-row, the negatives relative to the gold are uniform over the n-2 others
    # (offsets binned into 40 cells so that every cell expects plenty of draws).
    offsets = ((neg.ids - gold[:, None]) % n).flatten() - 2
    cell = offsets * 40 // (n - 2)
    counts = torch.bincount(cell, minlength=40).double()
    values_per_cell = torch.bincount(torch.arange(n - 2) * 40 // (n - 2), minlength=40).double()
    assert chi2_pvalue(counts, values_per_cell * (b * k / (n - 2))) > 1e-4
    # and each draw position is uniform too (no bias towards small ids in the first column)
    first = torch.bincount(((neg.ids[:, 0] - gold) % n), minlength=n)[2:].double()
    if n == 40:
        assert chi2_pvalue(first, torch.full_like(first, b / (n - 2))) > 1e-4


def test_random_sampler_errors_when_kb_too_small():
    with pytest.raises(ValueError, match="only 3 eligible"):
        ng.sample_random(4, 4, torch.tensor([0]), generator=0)
    with pytest.raises(ValueError, match=r"exclude must be int64 \[B=1, E\]"):
        ng.sample_random(40, 4, torch.tensor([0]), generator=0, exclude=torch.tensor([1, 2]))


@pytest.mark.parametrize("p,k,want", [(50, 63, 32), (0, 63, 0), (100, 63, 63), (25, 63, 16), (10, 63, 6),
                                      (50, 1, 1), (50.0, 3, 2)])
def test_num_hard_rounds_half_up(p, k, want):
    assert ng.num_hard(p, k) == want


def test_num_hard_rejects_bad_p():
    with pytest.raises(ValueError, match=r"p must be in \[0, 100\]"):
        ng.num_hard(101, 63)


def _hard_result(scores: torch.Tensor, gold: torch.Tensor, k: int, sampler: str = "dense") -> ShardResult:
    if sampler == "block":
        return gumbel_topk_block(scores, k, gold, seed=4, query_keys=torch.arange(scores.shape[0]), block_rows=3)
    return ng.gumbel_topk_dense(scores, k, gold, seed=4, query_keys=torch.arange(scores.shape[0]))


def test_mixed_p50_composition_and_stratified_log_q():
    n, b = 500, 8
    scores = torch.randn(b, n, generator=torch.Generator().manual_seed(3))
    gold = torch.arange(b) * 7
    hard = _hard_result(scores, gold, ng.num_hard(50, 63))
    neg = ng.mixed_negatives(hard, n, 63, 50, gold, generator=1)
    assert neg.ids.shape == (b, 63) and int(neg.hard[0].sum()) == 32
    assert first_occurrence(neg.ids).all() and not (neg.ids == gold[:, None]).any()
    assert torch.equal(neg.ids[:, :32], hard.ids[:, :32])
    torch.testing.assert_close(neg.log_q[:, :32], ng.hard_negatives(hard, 32).log_q)
    torch.testing.assert_close(neg.log_q[:, 32:], torch.full((b, 31), -math.log(n - 1)))


def test_mixed_mixture_log_q_matches_formula():
    n, b, p = 300, 5, 30
    scores = torch.randn(b, n, generator=torch.Generator().manual_seed(4))
    gold = torch.tensor([3, 1, 4, 1, 5])
    k_hard = ng.num_hard(p, 15)
    hard = _hard_result(scores, gold, k_hard)
    neg = ng.mixed_negatives(hard, n, 15, p, gold, generator=2,
                             random_scores_fn=lambda ids: scores.gather(1, ids))
    masked = scores.double().clone()
    masked[torch.arange(b), gold] = float("-inf")
    soft = torch.softmax(masked, 1).gather(1, neg.ids)
    a = k_hard / 15
    want = torch.log(a * soft + (1 - a) / (n - 1))
    torch.testing.assert_close(neg.log_q, want.float())


def test_select_topk_ties_go_to_lower_position():
    keys = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0, 5.0, float("-inf")]],
                        dtype=torch.float64)
    for k in range(1, 7):
        got = select_topk(keys, k)
        for row in range(2):
            want = sorted(range(6), key=lambda j: (-keys[row, j].item(), j))[:k]
            assert got[row].tolist() == want


def test_merge_results_equals_flat_selection():
    gen = torch.Generator().manual_seed(5)
    b, n, k = 3, 60, 7
    keys = torch.randint(0, 5, (b, n), generator=gen).double()  # many ties
    ids = torch.arange(n).expand(b, n)
    parts = [(0, 13), (13, 40), (40, 60)]
    shard = [ShardResult(ids[:, a:c], keys[:, a:c].float(), keys[:, a:c], torch.logsumexp(keys[:, a:c], 1),
                         None, version=v) for v, (a, c) in enumerate(parts)]
    shard = [merge_results([s], k) for s in shard]
    merged = merge_results(shard, k)
    want = torch.tensor([sorted(range(n), key=lambda j: (-keys[r, j].item(), j))[:k] for r in range(b)])
    assert torch.equal(merged.ids, want)
    torch.testing.assert_close(merged.log_z, torch.logsumexp(keys, 1))
    assert merged.version == 0 and merged.tail_log_z is None
    flat = result_from_keys(keys, keys.float(), ids, k)
    assert torch.equal(flat.ids, want)


def test_merge_pads_missing_slots_and_checks_batch():
    r = ShardResult(torch.tensor([[4, -1]]), torch.tensor([[1.0, float("-inf")]]),
                    torch.tensor([[1.0, float("-inf")]], dtype=torch.float64))
    m = merge_results([r], 3)
    assert m.ids.tolist() == [[4, -1, -1]]
    with pytest.raises(ValueError, match="batch size"):
        merge_results([r, ShardResult(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2),
                                      torch.zeros(2, 2, dtype=torch.float64))], 2)


def test_first_occurrence_and_isin_rows_against_python():
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-1, 6, (5, 12), generator=gen)
    sets = torch.randint(-1, 6, (5, 3), generator=gen)
    for r in range(5):
        seen, row = set(), x[r].tolist()
        want = []
        for v in row:
            want.append(v not in seen)
            seen.add(v)
        assert first_occurrence(x)[r].tolist() == want
        assert isin_rows(x, sets)[r].tolist() == [v >= 0 and v in sets[r].tolist() for v in row]


@pytest.mark.parametrize("sampler", ["dense", "block"])
def test_mixed_random_part_is_uniform_over_rows_neither_gold_nor_hard(sampler):
    # The random part is taken from a pool drawn BEFORE the hard part is known (so shards can
    # score it in the same call); dropping the pool's hard rows must leave a uniform sample.
    n, k1, draws = 12, 6, 20000
    scores = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
    gold = torch.tensor([2])
    hard = _hard_result(scores, gold, ng.num_hard(50, k1), sampler)
    hard_ids = set(hard.ids[0, :3].tolist())
    same_hard = ShardResult(*(t.expand(draws, *t.shape[1:]) if isinstance(t, torch.Tensor) else t for t in hard))
    neg = ng.mixed_negatives(same_hard, n, k1, 50, gold.expand(draws), generator=0)  # one pool per row
    assert (neg.ids[:, :3].sort(1).values == torch.tensor(sorted(hard_ids))).all()
    counts = torch.bincount(neg.ids[:, 3:].reshape(-1), minlength=n).float()
    others = [r for r in range(n) if r != 2 and r not in hard_ids]
    assert counts[[2, *hard_ids]].sum() == 0
    freq = counts[others] / draws
    # each of the 8 other rows is in the 3 random slots with probability 3/8; 5 sigma ~ 0.017
    assert torch.allclose(freq, torch.full_like(freq, 3 / 8), atol=0.017), freq
