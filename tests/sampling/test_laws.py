"""dist_nce/sampling/laws.py against references written out by hand: the chi-square tail at even degrees
of freedom in closed form, the pooling done by hand, the inclusion probabilities by enumerating every
ordered triple, and the successive-draw law on draws from torch.multinomial, which draws without
replacement one draw at a time, as the law assumes."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from dist_nce.sampling.laws import chi2_p, inclusion3, successive_law, two_sample_p


def chi2_tail_even(dof: int, stat: float) -> float:
    """P(chi2_dof >= stat) for even dof: exp(-x) * sum_{i < dof/2} x^i / i!, with x = stat / 2."""
    x = stat / 2
    return math.exp(-x) * sum(x ** i / math.factorial(i) for i in range(dof // 2))


def test_chi2_p_pools_the_small_cells_and_matches_the_closed_form_tail():
    observed = torch.tensor([45.0, 25, 22, 5, 2, 1], dtype=torch.float64)
    expected = torch.tensor([40.0, 30, 20, 7, 2, 1], dtype=torch.float64)  # the last two (< 5) pool into one cell of 3
    stat = 5 ** 2 / 40 + 5 ** 2 / 30 + 2 ** 2 / 20 + 2 ** 2 / 7 + 0 ** 2 / 3
    assert chi2_p(observed, expected) == pytest.approx(chi2_tail_even(4, stat), rel=1e-10)
    # no small cell: the empty pooled cell is dropped, 3 cells, 2 degrees of freedom
    stat = 4 ** 2 / 30 + 1 ** 2 / 30 + 5 ** 2 / 40
    got = chi2_p(torch.tensor([34.0, 31, 35], dtype=torch.float64), torch.tensor([30.0, 30, 40], dtype=torch.float64))
    assert got == pytest.approx(math.exp(-stat / 2), rel=1e-10)
    assert chi2_p(expected, expected) == pytest.approx(1.0)


def test_two_sample_p_matches_the_statistic_written_out():
    x = [30, 20, 12, 10, 3, 1]
    y = [25, 25, 8, 14, 2, 0]  # the last two cells have < 10 draws together: pooled, 4 + 2
    a = torch.repeat_interleave(torch.arange(6), torch.tensor(x))
    b = torch.repeat_interleave(torch.arange(6), torch.tensor(y))
    stat = sum((u - v) ** 2 / (u + v) for u, v in zip(x[:4] + [4], y[:4] + [2]))
    assert two_sample_p(a[torch.randperm(len(a))], b, 6) == pytest.approx(chi2_tail_even(4, stat), rel=1e-10)
    assert two_sample_p(a, a, 6) == pytest.approx(1.0)


def test_inclusion3_equals_the_sum_over_ordered_triples():
    p = torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 0)
    want = torch.zeros(6, dtype=torch.float64)
    for i, j, k in itertools.permutations(range(6), 3):
        want[[i, j, k]] += p[i] * p[j] / (1 - p[i]) * p[k] / (1 - p[i] - p[j])
    got = inclusion3(p)
    assert torch.allclose(got, want, rtol=1e-12, atol=0) and float(got.sum()) == pytest.approx(3.0)


def draws_without_replacement(s: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    """[draws, 3] rows 1..n-1 drawn successively without replacement proportional to exp(s[1:])."""
    p = torch.softmax(s[1:].double(), 0).expand(draws, -1)
    return torch.multinomial(p, 3, replacement=False, generator=torch.Generator().manual_seed(seed)) + 1


S = torch.linspace(-1.5, 2.0, 13)[torch.randperm(13, generator=torch.Generator().manual_seed(5))]


def test_successive_law_accepts_exact_draws_and_its_control_rejects():
    law = successive_law(draws_without_replacement(S, 40_000, 1), S, 1.3)
    assert law["first_draw_p"] > 1e-4 and law["ordered_pairs_p"] > 1e-4 and law["inclusion_max_z"] < 5
    assert law["wrong_temperature_p"] < 1e-6  # the control: the same draws against a law they do not follow


def test_successive_law_rejects_draws_from_another_law():
    wrong = successive_law(draws_without_replacement(S / 1.3, 40_000, 1), S, 1.3)
    assert wrong["first_draw_p"] < 1e-6 and wrong["ordered_pairs_p"] < 1e-6 and wrong["inclusion_max_z"] > 5
    # with replacement: a row may repeat, so the inclusion frequencies fall below the law's
    p = torch.softmax(S[1:].double(), 0).expand(40_000, -1)
    repeats = torch.multinomial(p, 3, replacement=True, generator=torch.Generator().manual_seed(2)) + 1
    assert successive_law(repeats, S, 1.3)["inclusion_max_z"] > 5
