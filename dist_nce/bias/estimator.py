"""Gradient bias of hard-negative NCE (Zhang & Stratos 2021, Theorem 1), measured.

The paper views the NCE loss as an estimator of the cross-entropy gradient. On a finite
label space, with a population ``pop(y|x)`` and mention weights ``w_x``,

    J_CE(θ)   = Σ_x w_x Σ_y pop(y|x) [-log p_θ(y|x)]
    J_NCE(θ)  = Σ_x w_x Σ_y1 pop(y1|x) E_{y2..yK ~ q(.|x,y1)} [ℓ(s_θ(x, y1..yK))]
    b(θ)      = ∇J_CE(θ) - E[∇J_NCE(θ)]
              = Σ_x w_x Σ_y (p_θ(y|x) - γ_θ(y|x)) ∇s_θ(x, y)                  (Theorem 1)

where ℓ is the training loss itself, :func:`dist_nce.modeling.losses.nce_loss` (J_HARD) or
:func:`dist_nce.modeling.losses.adjusted_nce_loss` (negatives' scores lowered by
log((K-1) q(y|x,y1))), with the gold at index 0, and γ_θ(y|x) is the expected softmax
mass the K candidates put on y.

The estimator works in *score space*: every gradient above is ``Jᵀ c`` for the Jacobian
J = ∂s/∂θ of the [B, N] score matrix and a coefficient matrix c [B, N] (``w (p - pop)``
for CE, ``w (π - e_gold)`` scattered over the candidates for one draw of NCE). One
forward pass of the score model therefore serves the exact CE gradient and all S Monte
Carlo draws; each draw costs one vector-Jacobian product and nothing else.

What is reported for each negative scheme (:class:`BiasEstimate`):

* ``bias_norm`` = ||b̂|| with b̂ = ∇J_CE - (1/S) Σ_s ∇J_NCE^(s), the quantity the paper
  plots (its code uses S = 10);
* ``mc_se`` = sqrt(tr Σ̂ / S), Σ̂ the sample covariance of the S per-draw gradients: the
  norm of the Monte Carlo standard error of b̂. If b = 0 then E||b̂||² = tr Σ / S, so
  ``bias_norm`` within a few ``mc_se`` of 0 is not evidence of bias;
* ``bias_norm_debiased`` = sqrt(max(0, ||b̂||² - mc_se²)), from the unbiased estimate of
  ||b||² (||b̂||² alone is inflated by the Monte Carlo variance);
* ``tv_p_gamma`` = Σ_x w_x ½ Σ_y |p_θ(y|x) - γ̂(y|x)|, the score-space integrand of
  Theorem 1 (model-free; also Monte Carlo, so also inflated by noise).

Which negatives make b vanish at p_θ = pop (checked by exact enumeration in
tests/bias/test_estimator.py). The issue's Theorem 2 check, "b = 0 when p_θ = pop and the negatives
are iid from p_θ", holds with the score-adjusted loss only:

* negatives iid from p_θ(.|x, y ≠ y1) with the score-adjusted loss: b = 0 at
  *every* θ, because the importance-sampled partition function is then exact;
* uniform negatives without replacement, gold excluded (the project's random sampler),
  with the plain loss: the K-tuple's law is then ∝ exp s(x, y1) on distinct tuples, and
  symmetrising over the gold's position gives γ_θ = p_θ (so do iid uniform negatives
  over all labels, gold included; iid uniform *excluding* the gold does not);
* NOT negatives from p_θ with the plain loss (iid or without replacement = hard): the
  softmax over candidates drawn from p_θ resamples towards p_θ², so γ_θ ≠ p_θ.

Also here: the Zeshel-style protocol on a small label set (Appendix C) for any retriever-like
score model. The paper's synthetic experiment is :mod:`dist_nce.bias.synthetic`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from dist_nce.sampling.modes import sampler_for
from dist_nce.sampling.samplers import FlatScores

NegativeKind = Literal["random", "hard", "mixed", "iid_model"]
KINDS: tuple[str, ...] = ("random", "hard", "mixed", "iid_model")

# Cap on the [draws x rows x labels] block sampled at once (fp32 elements): bounds memory
# when S x R x N is large (e.g. 10 draws x 1000 golds x 1000 labels = 1e7).
_SAMPLE_BUDGET = 1 << 24


@dataclass(frozen=True)
class NegativeScheme:
    """How the K-1 negatives of one gold are drawn, and which loss scores them.

    kind: "random" (uniform, gold excluded, no duplicates), "hard" (∝ exp(s) without
    replacement, gold excluded), "mixed" (``hard_fraction`` hard, rest random), all from
    :mod:`dist_nce.sampling.negatives`; "iid_model" (iid from p_θ(.|x, y ≠ y1), *with*
    replacement) exists for the theory checks only. ``adjusted``: score the candidates
    with :func:`dist_nce.modeling.losses.adjusted_nce_loss` instead of ``nce_loss``.
    """

    kind: NegativeKind
    num_negatives: int
    hard_fraction: float = 0.5
    adjusted: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"negative kind {self.kind!r}: expected one of {list(KINDS)}")
        if self.num_negatives < 1:
            raise ValueError(f"num_negatives must be >= 1, got {self.num_negatives}")
        if not 0.0 <= self.hard_fraction <= 1.0:
            raise ValueError(f"hard_fraction must be in [0, 1], got {self.hard_fraction}")

    @property
    def name(self) -> str:
        base = f"mixed{round(100 * self.hard_fraction)}" if self.kind == "mixed" else self.kind
        return base + ("+adjusted" if self.adjusted else "")


@dataclass(frozen=True)
class BiasEstimate:
    """One negative scheme's Monte Carlo estimate of Theorem 1's bias (see module doc)."""

    scheme: str
    num_negatives: int
    num_draws: int
    loss_nce: float
    loss_nce_se: float
    bias_norm: float
    mc_se: float
    bias_norm_debiased: float
    tv_p_gamma: float
    bias: Tensor | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "bias"}


@dataclass(frozen=True)
class BiasReport:
    """Exact cross-entropy quantities plus one :class:`BiasEstimate` per scheme."""

    loss_ce: float
    grad_ce_norm: float
    estimates: dict[str, BiasEstimate]

    def to_json(self) -> dict:
        return {
            "loss_ce": self.loss_ce,
            "grad_ce_norm": self.grad_ce_norm,
            "schemes": {k: v.to_json() for k, v in self.estimates.items()},
        }


class GoldRows(NamedTuple):
    """The (mention, gold) pairs with pop(gold|mention) > 0: ``mention`` [R], ``gold`` [R]
    (int64) and ``weight`` [R] = w_mention * pop(gold|mention)."""

    mention: Tensor
    gold: Tensor
    weight: Tensor


def check_population(pop: Tensor, weights: Tensor | None = None) -> Tensor:
    """Validate ``pop`` [B, N] (rows are distributions) and return weights [B] (default
    uniform 1/B), raising ValueError naming the offending row otherwise."""
    if pop.dim() != 2:
        raise ValueError(f"pop must be [B, N], got shape {tuple(pop.shape)}")
    if (pop < 0).any():
        raise ValueError("pop has negative entries")
    sums = pop.sum(-1)
    bad = (sums - 1).abs() > 1e-4
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"pop row {i} sums to {float(sums[i]):.6f}, expected 1")
    if weights is None:
        return torch.full((pop.shape[0],), 1.0 / pop.shape[0], dtype=pop.dtype)
    if weights.shape != (pop.shape[0],) or (weights < 0).any():
        raise ValueError(f"weights must be non-negative of shape [{pop.shape[0]}], got {tuple(weights.shape)}")
    return weights / weights.sum()


def gold_rows(pop: Tensor, weights: Tensor) -> GoldRows:
    """Enumerate the golds: the expectation over y1 ~ pop(.|x) is taken exactly, so only
    the negatives are Monte Carlo (as in the authors' code)."""
    mention, gold = (pop > 0).nonzero(as_tuple=True)
    return GoldRows(mention, gold, weights[mention] * pop[mention, gold])


def ce_coefficients(scores: Tensor, pop: Tensor, weights: Tensor) -> tuple[Tensor, float]:
    """∂J_CE/∂s = w_x (p_θ(y|x) - pop(y|x)) [B, N], and J_CE. ``scores`` [B, N]."""
    leaf = scores.detach().requires_grad_(True)
    loss = -(weights[:, None] * pop * torch.log_softmax(leaf, -1)).sum()
    (coef,) = torch.autograd.grad(loss, leaf)
    return coef, float(loss.detach())


def _row_losses(cand: Tensor, log_q: Tensor | None) -> Tensor:
    """Per-row losses [R] of candidate scores [R, K] (gold at 0) under the training loss
    itself: ``nce_loss``, or ``adjusted_nce_loss`` when the sampling log-probabilities
    ``log_q`` [R, K-1] are given."""
    from dist_nce.modeling.losses import adjusted_nce_loss, nce_loss

    if log_q is None:
        return nce_loss(cand, reduction="none")
    return adjusted_nce_loss(cand, log_q, reduction="none")


def nce_coefficients(
    scores: Tensor, rows: GoldRows, negatives: Tensor, log_q: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Per-draw ∂J_NCE/∂s [S, B, N] and J_NCE [S].

    scores [B, N]; negatives [S, R, K-1] label ids for the R gold rows; log_q [S, R, K-1]
    sampling log-probabilities (only for the score-adjusted loss, else None).
    """
    S, R, k = negatives.shape
    leaf = scores.detach().expand(S, *scores.shape).clone().requires_grad_(True)
    cand = torch.cat([rows.gold.expand(S, R)[..., None], negatives], -1)  # [S, R, K]
    draw = torch.arange(S)[:, None, None]
    cand_scores = leaf[draw, rows.mention[None, :, None], cand]
    lq = None if log_q is None else log_q.reshape(S * R, k)
    losses = _row_losses(cand_scores.reshape(S * R, k + 1), lq).view(S, R)
    per_draw = (losses * rows.weight.to(losses.dtype)).sum(-1)
    (coef,) = torch.autograd.grad(per_draw.sum(), leaf)
    return coef, per_draw.detach()


def _iid_model_negatives(row_scores: Tensor, gold: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """k negatives iid (with replacement) from p_θ(.|x, y ≠ gold): the sampler of the
    unbiasedness results, not a training sampler. Returns ids [R, k], log q [R, k]."""
    logits = row_scores.detach().float().scatter(-1, gold[:, None], float("-inf"))
    log_q = torch.log_softmax(logits, -1)
    ids = torch.multinomial(log_q.exp(), k, replacement=True, generator=generator)
    return ids, log_q.gather(-1, ids)


def sample_negatives(scheme: NegativeScheme, row_scores: Tensor, gold: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """K-1 negatives per row: ids [R, K-1] and their sampling log q [R, K-1].

    row_scores [R, N] are the model's scores for each row's mention; gold [R].
    """
    if scheme.kind == "iid_model":
        gen = torch.Generator().manual_seed(seed)
        return _iid_model_negatives(row_scores, gold, scheme.num_negatives, gen)
    rows, k = row_scores.shape[0], scheme.num_negatives
    keys = torch.arange(rows, dtype=torch.int64)  # one Gumbel stream per row of this call
    # The training samplers themselves, drawing from this call's full score matrix.
    sampler = sampler_for(scheme.kind, k, 100 * scheme.hard_fraction)
    neg = sampler.draw(FlatScores(row_scores), None, gold, seed, keys).result().negatives
    return neg.ids, neg.log_q


def _flat_vjp(scores: Tensor, params: Sequence[Tensor], coef: Tensor) -> Tensor:
    """Jᵀ coef as one flat vector over ``params`` (unused parameters contribute zeros)."""
    grads = torch.autograd.grad(scores, params, grad_outputs=coef.to(scores.dtype), retain_graph=True,
                                allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def _draw_coefficients(
    scheme: NegativeScheme, scores: Tensor, rows: GoldRows, num_draws: int, seed: int
) -> tuple[Tensor, Tensor]:
    """All S draws' coefficients [S, B, N] and losses [S], sampled in memory-bounded chunks."""
    R, N = len(rows.gold), scores.shape[1]
    chunk = max(1, min(num_draws, _SAMPLE_BUDGET // max(1, R * N)))
    coefs, losses = [], []
    for start in range(0, num_draws, chunk):
        S = min(chunk, num_draws - start)
        row_scores = scores.detach()[rows.mention].repeat(S, 1)  # [S*R, N]
        # Distinct seeds per (scheme, chunk) so schemes and chunks never share noise.
        ids, log_q = sample_negatives(scheme, row_scores, rows.gold.repeat(S), seed + start)
        negs = ids.view(S, R, -1)
        lq = log_q.view(S, R, -1) if scheme.adjusted else None
        c, l = nce_coefficients(scores, rows, negs, lq)
        coefs.append(c)
        losses.append(l)
    return torch.cat(coefs), torch.cat(losses)


def estimate_bias(
    scores: Tensor,
    params: Iterable[Tensor],
    pop: Tensor,
    schemes: Sequence[NegativeScheme],
    num_draws: int,
    seed: int = 0,
    weights: Tensor | None = None,
    keep_vectors: bool = False,
) -> BiasReport:
    """Estimate b(θ) of Theorem 1 for each scheme with ``num_draws`` Monte Carlo draws.

    scores: [B, N] s_θ(x, y) for B mentions and all N labels, *with* the autograd graph
        to ``params`` (the estimator only differentiates; it never steps).
    pop: [B, N] population pop(y|x) (rows sum to 1; one-hot rows for labelled mentions).
    weights: [B] mention weights w_x (default uniform).
    keep_vectors: also return the bias vectors b̂ (flat over ``params``) in the estimates.
    """
    if num_draws < 2:
        raise ValueError(f"num_draws must be >= 2 to estimate the Monte Carlo error, got {num_draws}")
    if scores.shape != pop.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and pop {tuple(pop.shape)} must both be [B, N]")
    names = [s.name for s in schemes]
    if len(set(names)) != len(names):
        raise ValueError(f"schemes must have distinct names, got {names}")
    params = [p for p in params if p.requires_grad]
    w = check_population(pop, weights).to(scores.dtype)
    pop = pop.to(scores.dtype)
    rows = gold_rows(pop, w)
    c_ce, loss_ce = ce_coefficients(scores, pop, w)
    grad_ce_norm = float(_flat_vjp(scores, params, c_ce).norm())
    estimates = {}
    for i, scheme in enumerate(schemes):
        if scheme.num_negatives > pop.shape[1] - 1 and scheme.kind != "iid_model":
            raise ValueError(f"{scheme.name}: {scheme.num_negatives} negatives without replacement "
                             f"need at least {scheme.num_negatives + 1} labels, got {pop.shape[1]}")
        coefs, losses = _draw_coefficients(scheme, scores, rows, num_draws, seed + 1_000_003 * i)
        mean = coefs.mean(0)
        bias = _flat_vjp(scores, params, c_ce - mean)
        # tr Σ̂: spread of the per-draw gradients Jᵀc_s around their mean Jᵀc̄.
        spread = sum(float(_flat_vjp(scores, params, c - mean).square().sum()) for c in coefs)
        mc_var = spread / (num_draws - 1) / num_draws
        norm_sq = float(bias.square().sum())
        estimates[scheme.name] = BiasEstimate(
            scheme=scheme.name,
            num_negatives=scheme.num_negatives,
            num_draws=num_draws,
            loss_nce=float(losses.mean()),
            loss_nce_se=float(losses.std() / math.sqrt(num_draws)),
            bias_norm=math.sqrt(norm_sq),
            mc_se=math.sqrt(mc_var),
            bias_norm_debiased=math.sqrt(max(0.0, norm_sq - mc_var)),
            tv_p_gamma=0.5 * float((c_ce - mean).abs().sum()),
            bias=bias.detach() if keep_vectors else None,
        )
    return BiasReport(loss_ce=loss_ce, grad_ce_norm=grad_ce_norm, estimates=estimates)


# --------------------------------------------------------------------------------------
# Zeshel-style protocol (paper Appendix C): labelled mentions against a small entity set.
# --------------------------------------------------------------------------------------


def labelled_mentions_bias(
    score_fn: Callable[[object], Tensor],
    mention_batch: object,
    gold: Tensor,
    model: nn.Module,
    schemes: Sequence[NegativeScheme],
    num_draws: int = 500,
    seed: int = 0,
    keep_vectors: bool = False,
) -> BiasReport:
    """Bias for B labelled mentions against the N entities ``score_fn`` scores.

    score_fn(mention_batch) -> [B, N] scores of each mention against every entity of the
    small label set (e.g. a retriever scoring 64 mentions against 128 entities that
    include their golds); gold [B] int64 column of each mention's gold entity. The
    population is the empirical one: uniform over mentions, one-hot on the gold.
    """
    scores = score_fn(mention_batch)
    if scores.dim() != 2 or scores.shape[0] != gold.shape[0]:
        raise ValueError(f"score_fn must return [B={gold.shape[0]}, N] scores, got {tuple(scores.shape)}")
    if ((gold < 0) | (gold >= scores.shape[1])).any():
        raise ValueError(f"gold ids must be in [0, {scores.shape[1]}), got min {int(gold.min())} max {int(gold.max())}")
    pop = torch.nn.functional.one_hot(gold, scores.shape[1]).to(scores.dtype)
    return estimate_bias(scores, model.parameters(), pop, schemes, num_draws, seed=seed, keep_vectors=keep_vectors)
