"""dist_nce.bias.gradbias against enumeration: on a KB of 6 entities every candidate set can be
listed with its probability, so Theorem 1's bias is known exactly and the monitor's Monte
Carlo estimate must match it within its own standard error."""
from __future__ import annotations

import itertools

import pytest
import torch

from dist_nce.bias.gradbias import LseGrad, estimate, lse_grad_all, lse_grad_rows, merge, summary
from dist_nce.modeling.scoring import Reps, ScoreSpec, score_all
from dist_nce.sampling.negatives import sample_hard, sample_random

N, D, K = 6, 4, 3  # entities, dimension, candidates (gold + 2 negatives)
DUAL = ScoreSpec.preset("dual")


def kb(scale: float = 1.0, seed: int = 0) -> tuple[Reps, Reps, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ent = torch.randn(N, D, generator=g, dtype=torch.float64)
    q = scale * torch.randn(2, D, generator=g, dtype=torch.float64)
    return Reps(q), Reps(ent), torch.tensor([1, 4])


def exact_bias(q: Reps, ent: Reps, gold: torch.Tensor, mode: str) -> torch.Tensor:
    """b = sum_y p(y) f_y - sum_C P(C) sum_{c in C} softmax_C(c) f_c, every ordered C enumerated."""
    s = (q.vecs @ ent.vecs.T)  # [B, N]; dual: ds/dq = f_y
    out = []
    for b in range(q.vecs.shape[0]):
        p = torch.softmax(s[b], 0)
        full = p @ ent.vecs
        others = [y for y in range(N) if y != int(gold[b])]
        pn = torch.softmax(s[b, others], 0)  # hard: exp(s) over the KB minus the gold
        expect = torch.zeros(D, dtype=torch.float64)
        for i, j in itertools.permutations(range(len(others)), K - 1):
            if mode == "hard":
                prob = pn[i] * pn[j] / (1 - pn[i])
            else:
                prob = torch.tensor(1.0 / (len(others) * (len(others) - 1)), dtype=torch.float64)
            c = [int(gold[b]), others[i], others[j]]
            expect += prob * (torch.softmax(s[b, c], 0) @ ent.vecs[c])
        out.append(full - expect)
    return torch.stack(out)


def draw_sets(q: Reps, ent: Reps, gold: torch.Tensor, mode: str, r: int) -> torch.Tensor:
    """[B, r, K] candidate sets (gold first) from the project's own samplers."""
    scores = score_all(DUAL, q, ent).float()
    sets = []
    for seed in range(r):
        if mode == "hard":
            neg = sample_hard(scores, K - 1, gold, seed=seed, query_keys=torch.arange(2)).ids
        else:
            neg = sample_random(N, K - 1, gold, seed).ids
        sets.append(torch.cat([gold[:, None], neg], dim=1))
    return torch.stack(sets, dim=1)


def test_full_gradient_is_the_softmax_mean_and_shards_merge_exactly():
    q, ent, _ = kb()
    full = lse_grad_all(DUAL, q, ent, chunk_rows=4, dtype=torch.float64)
    s = q.vecs @ ent.vecs.T
    torch.testing.assert_close(full.lse, torch.logsumexp(s, 1))
    torch.testing.assert_close(full.grad, torch.softmax(s, 1) @ ent.vecs)
    # two "shards" of rows, and a set split across them, merge to the unsplit answer
    halves = [lse_grad_all(DUAL, q, Reps(ent.vecs[a:b]), dtype=torch.float64) for a, b in ((0, 2), (2, 6))]
    merged = merge(halves)
    torch.testing.assert_close(merged.lse, full.lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.grad, full.grad, rtol=1e-12, atol=1e-12)
    rows = torch.tensor([[[1, 0, 5]], [[4, 2, 3]]])
    whole = lse_grad_rows(DUAL, q, ent, rows, dtype=torch.float64)
    lo = torch.where(rows < 2, rows, -1)
    hi = torch.where(rows >= 2, rows - 2, -1)
    parts = merge([lse_grad_rows(DUAL, q, Reps(ent.vecs[:2]), lo, dtype=torch.float64),
                   lse_grad_rows(DUAL, q, Reps(ent.vecs[2:]), hi, dtype=torch.float64)])
    torch.testing.assert_close(parts.lse, whole.lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-12)
    # a set with no row in a part contributes nothing (no NaN)
    empty = lse_grad_rows(DUAL, q, Reps(ent.vecs[:2]), torch.full((2, 1, 3), -1), dtype=torch.float64)
    assert torch.isinf(empty.lse).all() and not empty.grad.isnan().any() and empty.grad.abs().sum() == 0


@pytest.mark.parametrize("mode", ["hard", "random"])
def test_monte_carlo_bias_matches_enumeration_within_its_standard_error(mode):
    q, ent, gold = kb(scale=2.0)
    exact = exact_bias(q, ent, gold, mode)
    r = 3000
    sets = lse_grad_rows(DUAL, q, ent, draw_sets(q, ent, gold, mode, r), dtype=torch.float64)
    est = estimate(lse_grad_all(DUAL, q, ent, dtype=torch.float64), sets)
    se_component = sets.grad.std(dim=1) / r ** 0.5  # [B, D]
    z = (est.bias - exact) / se_component
    assert z.abs().max() < 4.5, (mode, z)
    assert ((est.norm - exact.norm(dim=1)).abs() < 4.5 * est.se + 4.5 * est.noise / r ** 0.5).all()
    assert (est.se > 0).all() and (est.noise > 0).all()
    # the estimate is not the trivial one: the bias is clearly non-zero here
    assert (exact.norm(dim=1) > 10 * est.se).all()


def test_hard_negatives_have_less_bias_than_random_on_a_peaked_model():
    """Appendix C's ordering, exactly: when the model's softmax is peaked (a trained model),
    candidates drawn from it bias the gradient less than uniform ones."""
    q, ent, gold = kb(scale=3.0, seed=1)
    hard, rand = exact_bias(q, ent, gold, "hard"), exact_bias(q, ent, gold, "random")
    assert (hard.norm(dim=1) < rand.norm(dim=1)).all(), (hard.norm(dim=1), rand.norm(dim=1))
    s = summary(estimate(LseGrad(torch.zeros(2), hard), LseGrad(torch.zeros(2, 2), torch.zeros(2, 2, D))))
    assert s["bias/norm"] == pytest.approx(float(hard.norm(dim=1).mean()))


def test_gradient_through_a_multi_vector_score_matches_finite_differences():
    """SOM reads every mention column; autograd through score_all is the gradient there too."""
    spec = ScoreSpec.preset("som")
    g = torch.Generator().manual_seed(3)
    q = Reps(torch.randn(1, 3, D, generator=g, dtype=torch.float64), torch.tensor([[True, True, False]]))
    ent = Reps(torch.randn(N, 2, D, generator=g, dtype=torch.float64), torch.ones(N, 2, dtype=torch.bool))
    got = lse_grad_all(spec, q, ent, chunk_rows=4, dtype=torch.float64)
    eps = 1e-6
    for t, j in ((0, 1), (1, 3)):
        bumped = q.vecs.clone()
        bumped[0, t, j] += eps
        up = torch.logsumexp(score_all(spec, Reps(bumped, q.mask), ent), 1)
        bumped[0, t, j] -= 2 * eps
        down = torch.logsumexp(score_all(spec, Reps(bumped, q.mask), ent), 1)
        assert float(got.grad[0, t, j]) == pytest.approx(float((up - down) / (2 * eps)), rel=1e-5, abs=1e-8)
    assert float(got.grad[0, 2].abs().sum()) == 0.0  # a padded mention column takes no part


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_closed_form_gradients_equal_autograd(preset, m):
    """The closed forms of lse_grad_all and lse_grad_rows (a forward pass, then a GEMM on the chosen
    columns) against autograd through score_all / score_candidates: padded columns on both sides,
    tied columns, removed rows, rows split over chunks, sets with rows on another shard."""
    spec = ScoreSpec.preset(preset, m)
    g = torch.Generator().manual_seed(5)
    n, d = 37, 8
    if preset == "dual":
        q, ent = Reps(torch.randn(4, d, generator=g)), Reps(torch.randn(n, d, generator=g))
    else:
        cols = 3 if preset == "multi" else 5
        emask = torch.rand(n, cols, generator=g) < 0.7
        emask[:, 0] = True
        vecs = torch.randn(n, cols, d, generator=g)
        vecs[::3, 1] = vecs[::3, 0]  # repeated columns: a tie the max's gradient splits evenly
        emask[::3, :2] = True
        ent = Reps(vecs, emask)
        if preset == "multi":
            q = Reps(torch.randn(4, d, generator=g))
        else:
            qmask = torch.tensor([[True] * 4, [True, True, False, False], [True, False, True, False], [True] * 4])
            q = Reps(torch.randn(4, 4, d, generator=g), qmask)
    dead = torch.tensor([2, 3, 20, 36])
    # 3 sets of 5 per mention; -1 = a row another shard owns; mention 1's last set is all elsewhere
    rows = torch.randint(0, n, (4, 3, 5), generator=g)
    rows[0, 0, 1], rows[2, 1, :3], rows[1, 2] = -1, -1, -1
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        got = lse_grad_all(spec, q, ent, chunk_rows=16, dtype=dtype, dead=dead)
        want = lse_grad_all(spec, q, ent, chunk_rows=16, dtype=dtype, dead=dead, autograd=True)
        torch.testing.assert_close(got.lse, want.lse, rtol=tol, atol=tol)
        torch.testing.assert_close(got.grad, want.grad, rtol=tol, atol=tol)
        sets = lse_grad_rows(spec, q, ent, rows, dtype=dtype)
        ref = lse_grad_rows(spec, q, ent, rows, dtype=dtype, autograd=True)
        assert sets.grad.shape == (4, 3, *q.vecs.shape[1:]) and sets.lse[1, 2] == float("-inf")
        torch.testing.assert_close(sets.lse, ref.lse, rtol=tol, atol=tol)
        torch.testing.assert_close(sets.grad, ref.grad, rtol=tol, atol=tol)
    assert got.grad.shape == q.vecs.shape
    if preset == "som":  # padded mention columns get no gradient
        assert float(got.grad[1, 2:].abs().sum()) == 0.0 and float(got.grad[2, 3].abs().sum()) == 0.0
