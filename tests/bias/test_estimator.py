"""Theorem 1 estimator against exact enumeration; which negatives are unbiased at p_θ = pop
(Theorem 2); the Zeshel-style protocol; the synthetic-experiment job end to end."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from dist_nce.bias import estimator as B
from dist_nce.bias.estimator import NegativeScheme

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------
# Reference: E[∂J_NCE/∂s] by enumerating every ordered negative sequence of a tiny problem.
# ----------------------------------------------------------------------------------------


def _sequences(kind: str, s: Tensor, gold: int, k: int, hard_fraction: float):
    """(negatives, probability, log q per negative) for every ordered draw; s [N] float64."""
    from dist_nce.sampling.negatives import num_hard

    n = s.numel()
    w = s.exp()
    others = [y for y in range(n) if y != gold]
    z_excl = float(w[others].sum())
    if kind == "iid_model":
        q = {y: float(w[y]) / z_excl for y in others}
        for seq in itertools.product(others, repeat=k):
            yield seq, math.prod(q[y] for y in seq), [math.log(q[y]) for y in seq]
        return
    n_hard = {"random": 0, "hard": k, "mixed": num_hard(100 * hard_fraction, k)}[kind]
    for seq in itertools.permutations(others, k):
        prob, used = 1.0, 0.0
        for j, y in enumerate(seq):
            if j < n_hard:  # successive sampling ∝ exp(s) among the labels left
                prob *= float(w[y]) / (z_excl - used)
                used += float(w[y])
            else:  # uniform among the labels left
                prob *= 1.0 / (n - 1 - j)
        yield seq, prob, None


def exact_nce_coefficients(scores: Tensor, pop: Tensor, scheme: NegativeScheme) -> tuple[Tensor, float]:
    """Exact E[∂J_NCE/∂s] [B, N] and E[J_NCE], mention weights uniform, both losses written out by hand."""
    s_all = scores.detach().double()
    coef = torch.zeros_like(s_all)
    loss = 0.0
    b_count = s_all.shape[0]
    for x in range(b_count):
        for y1 in range(s_all.shape[1]):
            if pop[x, y1] == 0:
                continue
            wt = float(pop[x, y1]) / b_count
            for seq, prob, log_q in _sequences(scheme.kind, s_all[x], y1, scheme.num_negatives, scheme.hard_fraction):
                cand = [y1, *seq]
                c = s_all[x, cand].clone()
                if scheme.adjusted:
                    c[1:] -= math.log(scheme.num_negatives) + torch.tensor(log_q, dtype=torch.float64)
                pi = torch.softmax(c, 0)
                loss += wt * prob * float(-torch.log_softmax(c, 0)[0])
                g = pi.clone()
                g[0] -= 1.0
                coef[x].index_add_(0, torch.tensor(cand), wt * prob * g)
    return coef, loss


class Bilinear(nn.Module):
    """s(x, y) = m_x^T W e_y: a small nonlinear-in-parameters score model."""

    def __init__(self, num_mentions: int, num_labels: int, dim: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.m = nn.Parameter(torch.randn(num_mentions, dim, generator=g))
        self.e = nn.Parameter(torch.randn(num_labels, dim, generator=g))
        self.w = nn.Parameter(torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g))

    def forward(self, mentions: Tensor | None = None) -> Tensor:
        m = self.m if mentions is None else self.m[mentions]
        return m @ self.w @ self.e.T


def exact_bias(model: nn.Module, pop: Tensor, scheme: NegativeScheme) -> tuple[Tensor, float]:
    """b = Jᵀ(c_CE - E[c_NCE]) by enumeration, as a flat vector; and E[J_NCE]."""
    scores = model()
    weights = torch.full((pop.shape[0],), 1.0 / pop.shape[0])
    c_ce, _ = B.ce_coefficients(scores, pop, weights)
    c_nce, loss = exact_nce_coefficients(scores, pop, scheme)
    grads = torch.autograd.grad(scores, list(model.parameters()), grad_outputs=(c_ce.double() - c_nce).float())
    return torch.cat([g.reshape(-1) for g in grads]), loss


def _tiny_problem(seed: int = 0) -> tuple[Bilinear, Tensor]:
    model = Bilinear(num_mentions=2, num_labels=6, dim=3, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    pop = torch.softmax(2.0 * torch.randn(2, 6, generator=g), -1)
    return model, pop


# ----------------------------------------------------------------------------------------
# The estimator.
# ----------------------------------------------------------------------------------------


def test_nce_coefficients_match_closed_form():
    """Per-draw ∂J/∂s through the project's loss = w (π - e_gold) scattered, and
    the score-adjusted loss lowers only the negatives by log((K-1) q)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 7, generator=g)
    rows = B.GoldRows(torch.tensor([0, 0, 1]), torch.tensor([1, 4, 2]), torch.tensor([0.2, 0.3, 0.5]))
    negs = torch.tensor([[[0, 2, 3], [5, 6, 0], [4, 4, 6]], [[3, 2, 5], [1, 0, 6], [3, 0, 1]]])  # [S=2, R=3, 3]
    log_q = -torch.rand(2, 3, 3, generator=g)
    for lq in (None, log_q):
        coef, loss = B.nce_coefficients(scores, rows, negs, lq)
        want = torch.zeros(2, 2, 7, dtype=torch.float64)
        want_loss = torch.zeros(2, dtype=torch.float64)
        for s in range(2):
            for r in range(3):
                cand = torch.cat([rows.gold[r:r + 1], negs[s, r]])
                c = scores[rows.mention[r], cand].double()
                if lq is not None:
                    c[1:] -= math.log(3) + lq[s, r].double()
                pi = torch.softmax(c, 0)
                pi[0] -= 1
                want[s, rows.mention[r]].index_add_(0, cand, float(rows.weight[r]) * pi)
                want_loss[s] += float(rows.weight[r]) * float(-torch.log_softmax(c, 0)[0])
        torch.testing.assert_close(coef.double(), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(loss.double(), want_loss, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["random", "hard", "mixed"])
def test_estimator_matches_exact_enumeration(kind):
    """The Monte Carlo b̂ is within its own standard error of the enumerated b (and b is
    many standard errors from 0, so a wrong sampler or loss would be caught)."""
    model, pop = _tiny_problem()
    scheme = NegativeScheme(kind, 3)
    want, want_loss = exact_bias(model, pop, scheme)
    report = B.estimate_bias(model(), model.parameters(), pop, [scheme], num_draws=3000, seed=11, keep_vectors=True)
    est = report.estimates[scheme.name]
    err = float((est.bias - want).norm())
    assert est.mc_se > 0
    assert err < 3 * est.mc_se, (err, est.mc_se)
    assert float(want.norm()) > 10 * est.mc_se  # the check has power
    assert abs(est.loss_nce - want_loss) < 4 * est.loss_nce_se + 1e-6


def test_mc_standard_error_is_calibrated():
    """Across independent runs E||b̂ - b||² = mc_se²: the reported error is the real one."""
    model, pop = _tiny_problem(seed=5)
    scheme = NegativeScheme("hard", 2)
    want, _ = exact_bias(model, pop, scheme)
    sq_err, sq_se = [], []
    for run in range(40):
        est = B.estimate_bias(model(), model.parameters(), pop, [scheme], num_draws=20, seed=100 + run,
                              keep_vectors=True).estimates["hard"]
        sq_err.append(float((est.bias - want).square().sum()))
        sq_se.append(est.mc_se ** 2)
    ratio = sum(sq_err) / sum(sq_se)
    assert 0.6 < ratio < 1.6, ratio


def test_ce_gradient_is_exact():
    """With K-1 = N-1 negatives every label is a candidate, so J_NCE = J_CE and b = 0
    exactly, with zero Monte Carlo spread."""
    model, pop = _tiny_problem(seed=2)
    report = B.estimate_bias(model(), model.parameters(), pop, [NegativeScheme("random", 5)], num_draws=4)
    est = report.estimates["random"]
    assert est.bias_norm < 1e-5 * report.grad_ce_norm
    assert abs(est.loss_nce - report.loss_ce) < 1e-5


# ----------------------------------------------------------------------------------------
# Theorem 2: which negatives are unbiased when p_θ = pop.
# ----------------------------------------------------------------------------------------


class FreeScores(nn.Module):
    """θ = the score table itself, so p_θ can be set to pop exactly."""

    def __init__(self, scores: Tensor) -> None:
        super().__init__()
        self.s = nn.Parameter(scores.clone())

    def forward(self) -> Tensor:
        return self.s * 1.0


def _at_optimum(seed: int = 0) -> tuple[FreeScores, Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = 1.5 * torch.randn(2, 6, generator=g)
    return FreeScores(s), torch.softmax(s, -1)  # pop = p_θ


UNBIASED_AT_OPTIMUM = [
    NegativeScheme("iid_model", 3, adjusted=True),  # iid from p_θ(.|x, y≠y1), score-adjusted loss
    NegativeScheme("random", 3),  # uniform without replacement, plain loss (nce_loss)
]
BIASED_AT_OPTIMUM = [
    NegativeScheme("hard", 3),
    NegativeScheme("iid_model", 3),  # iid from p_θ with the plain loss: γ_θ ≠ p_θ
]


@pytest.mark.parametrize("scheme", UNBIASED_AT_OPTIMUM + BIASED_AT_OPTIMUM, ids=lambda s: s.name)
def test_theorem2_exact(scheme):
    """Enumeration at p_θ = pop: b = 0 for the unbiased schemes, clearly not for the others."""
    model, pop = _at_optimum()
    b, _ = exact_bias(model, pop, scheme)
    if scheme in UNBIASED_AT_OPTIMUM:
        assert float(b.norm()) < 1e-6
    else:
        assert float(b.norm()) > 1e-2


def test_theorem2_monte_carlo():
    """The estimator finds b̂ within a few standard errors of 0 exactly where b = 0, and
    far from 0 for the controls (a biased scheme at the optimum; an unbiased one away from it)."""
    model, pop = _at_optimum()
    schemes = UNBIASED_AT_OPTIMUM + BIASED_AT_OPTIMUM
    report = B.estimate_bias(model(), model.parameters(), pop, schemes, num_draws=2000, seed=7)
    for scheme in UNBIASED_AT_OPTIMUM:
        est = report.estimates[scheme.name]
        assert est.bias_norm < 3 * est.mc_se, est
    for scheme in BIASED_AT_OPTIMUM:
        est = report.estimates[scheme.name]
        assert est.bias_norm > 10 * est.mc_se, est
    off = FreeScores(model.s.detach() + torch.randn(2, 6, generator=torch.Generator().manual_seed(9)))
    est = B.estimate_bias(off(), off.parameters(), pop, [NegativeScheme("random", 3)], num_draws=2000,
                          seed=8).estimates["random"]
    assert est.bias_norm > 10 * est.mc_se, est


# ----------------------------------------------------------------------------------------
# Zeshel-style protocol: labelled mentions against a small entity set.
# ----------------------------------------------------------------------------------------


def test_labelled_mentions_protocol():
    """64 mentions x 128 entities, K=8: the sampler-corrected iid-model scheme is unbiased
    at any θ (b̂ within its error of 0) while random and hard negatives are measurably biased."""
    model = Bilinear(num_mentions=64, num_labels=128, dim=16, seed=4)
    gold = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(4))
    schemes = [NegativeScheme("random", 7), NegativeScheme("hard", 7), NegativeScheme("mixed", 7),
               NegativeScheme("iid_model", 7, adjusted=True)]
    report = B.labelled_mentions_bias(model, torch.arange(64), gold, model, schemes, num_draws=100, seed=1)
    assert set(report.estimates) == {"random", "hard", "mixed50", "iid_model+adjusted"}
    unbiased = report.estimates["iid_model+adjusted"]
    assert unbiased.bias_norm < 3 * unbiased.mc_se, unbiased
    for name in ("random", "hard", "mixed50"):
        est = report.estimates[name]
        assert est.bias_norm > 5 * est.mc_se, est
    json.dumps(report.to_json())


def test_labelled_mentions_with_tiny_bert_dual_retriever(tiny_model_dir):
    """The protocol on a real retriever, gradients through both BERT encoders, checked
    against a closed form: the untrained tiny BERT gives nearly equal [CLS] vectors, so
    p_θ is uniform over the N entities, where γ_θ = (p_θ - pop) (N-K)/(K(N-1)) + pop for
    random or hard negatives alike, i.e. b = (N-K)/(K(N-1)) ∇J_CE."""
    from dist_nce.core.text import encode_entity, encode_mention, load_tokenizer
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    tok = load_tokenizer(tiny_model_dir)
    retriever = Retriever.build(RetrieverConfig(preset="dual", mention_model=tiny_model_dir)).eval()
    names = ["Paris", "Lyon", "Nice", "Lille", "Nantes", "Brest", "Metz", "Rouen"]
    entities = [encode_entity(tok, n, f"{n} is a city in France number {i}.", 24) for i, n in enumerate(names)]
    mentions = [encode_mention(tok, "she moved to", n, "last year", 16) for n in names[:5]]

    def pad(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        return ids, (ids != 0).long()

    ent_ids, ent_mask = pad(entities)

    def score_fn(batch: tuple[Tensor, Tensor]) -> Tensor:
        # x30 so the gradients are not vanishingly small; p_θ stays uniform within 0.2%.
        return 30 * retriever.score_all(retriever.encode_mentions(*batch), retriever.encode_entities(ent_ids, ent_mask))

    gold = torch.arange(5)
    with torch.no_grad():
        assert float(torch.softmax(score_fn(pad(mentions)), -1).max()) < 0.126
    params = [p for p in retriever.parameters() if p.requires_grad]
    ce = nn.functional.cross_entropy(score_fn(pad(mentions)), gold)
    grad_ce = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                         for g, p in zip(torch.autograd.grad(ce, params, allow_unused=True), params)])
    n_ent, k = len(names), 2
    want = (n_ent - k) / (k * (n_ent - 1)) * grad_ce
    schemes = [NegativeScheme("hard", k - 1), NegativeScheme("random", k - 1)]
    report = B.labelled_mentions_bias(score_fn, pad(mentions), gold, retriever, schemes, num_draws=40,
                                      keep_vectors=True)
    assert report.grad_ce_norm == pytest.approx(float(grad_ce.norm()), rel=1e-4)
    for est in report.estimates.values():
        assert float((est.bias - want).norm()) < 3 * est.mc_se, est
        assert float(want.norm()) > 3 * est.mc_se  # the check has power


def test_labelled_mentions_rejects_bad_input():
    model = Bilinear(num_mentions=4, num_labels=8, dim=2, seed=0)
    with pytest.raises(ValueError, match=r"gold ids must be in \[0, 8\)"):
        B.labelled_mentions_bias(model, torch.arange(4), torch.tensor([0, 1, 2, 8]), model,
                                 [NegativeScheme("random", 2)], num_draws=2)
    with pytest.raises(ValueError, match=r"\[B=3, N\]"):
        B.labelled_mentions_bias(model, torch.arange(4), torch.tensor([0, 1, 2]), model,
                                 [NegativeScheme("random", 2)], num_draws=2)


def test_bad_population_and_schemes_are_rejected():
    scores = torch.zeros(2, 5, requires_grad=True)
    good = torch.full((2, 5), 0.2)
    with pytest.raises(ValueError, match="pop row 1 sums to"):
        B.estimate_bias(scores, [scores], torch.tensor([[1.0, 0, 0, 0, 0], [0.5, 0, 0, 0, 0]]),
                        [NegativeScheme("random", 2)], num_draws=2)
    with pytest.raises(ValueError, match="num_draws must be >= 2"):
        B.estimate_bias(scores, [scores], good, [NegativeScheme("random", 2)], num_draws=1)
    with pytest.raises(ValueError, match="need at least 6 labels"):
        B.estimate_bias(scores, [scores], good, [NegativeScheme("hard", 5)], num_draws=2)
    with pytest.raises(ValueError, match="negative kind 'easy'"):
        NegativeScheme("easy", 2)


# ----------------------------------------------------------------------------------------
# The synthetic experiment and its job.
# ----------------------------------------------------------------------------------------


def test_synthetic_run_is_deterministic_and_complete():
    from dist_nce.bias.synthetic import SyntheticConfig, run_synthetic

    cfg = SyntheticConfig(num_labels=40, hidden=8, updates=2, num_draws=3, temperature=0.05, seed=3)
    a, b = run_synthetic(cfg), run_synthetic(cfg)
    assert a == b
    assert [r["update"] for r in a["records"]] == [0, 1, 2]
    assert set(a["records"][-1]["schemes"]) == {"hard", "random", "mixed50"}
    assert 0 < a["population_entropy"] < math.log(40)


def _job_env() -> dict[str, str]:
    # The repository root on the path, as for an installed package (`pip install -e .`).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def test_bias_experiment_job(tmp_path):
    """Run the job as a user would, with tiny settings; it writes JSON, PNG and a manifest."""
    out = tmp_path / "bias"
    env = _job_env()
    cmd = [sys.executable, str(REPO / "jobs" / "bias_experiment.py"), "--out", str(out), "--updates", "3",
           "--set", "num_labels=60", "--set", "hidden=16", "--set", "num_draws=3", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "bias.json").read_text())
    assert len(result["records"]) == 4 and result["config"]["num_labels"] == 60
    assert (out / "bias.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "bias_experiment" and set(manifest["files"]) == {"bias.json", "bias.png"}


def test_bias_experiment_job_rejects_unknown_key(tmp_path):
    cmd = [sys.executable, str(REPO / "jobs" / "bias_experiment.py"), "--out", str(tmp_path / "x"),
           "--set", "num_lables=60"]
    proc = subprocess.run(cmd, cwd=REPO, env=_job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "num_lables" in proc.stderr
