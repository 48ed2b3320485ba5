"""Hard-negative NCE losses (Zhang & Stratos, 2021, section 3).

For a mention x with gold entity y_1 and negatives y_2 .. y_K drawn from a negative
distribution nu(y | x, y_1), the hard-negative NCE loss J_HARD (the "realistic loss",
eq. 5 of arXiv:2104.06245v1) is

    J_HARD = -log( exp s(x, y_1) / sum_{k=1..K} exp s(x, y_k) )

averaged over the batch. It is the full cross-entropy -log p(y_1 | x) when the K
candidates are the whole label set; the paper's analysis (Theorem 1) is about how
biased its gradient is otherwise, and shows hard negatives (nu = the model's own
distribution) reduce that bias.

The score-adjusted loss J_ADJ subtracts the log importance weight of each negative,
log((K - 1) nu(y_k | x, y_1)), from its score before the softmax, so that each sampled
negative stands for the probability mass its draw represents.

Both are pure functions of a score matrix whose column 0 is the gold.

Args (both losses):
    scores: [B, K] float, ``scores[:, 0]`` the gold's, ``scores[:, 1:]`` the negatives'.
    temperature: divides the scores (1.0, the paper's setting, leaves them as they are).
    reduction: "mean" (the paper's), "sum", or "none" for the per-mention losses [B].

Inputs:
    +--------------------------+-----------------------------------+----------------+
    | scores                   | log_q (adjusted loss only)        | result         |
    +==========================+===================================+================+
    | [B, K] gold in column 0  | [B, K-1] log nu(y_k | x, y_1)     | scalar or [B]  |
    +--------------------------+-----------------------------------+----------------+

References:
    W. Zhang and K. Stratos, "Understanding Hard Negatives in Noise Contrastive
    Estimation", NAACL 2021, arXiv:2104.06245, section 3.

Example::

    scores = retriever(mention_ids, mention_mask, cand_ids, cand_mask)  # [B, K]
    loss = nce_loss(scores)
    loss.backward()
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["mean", "sum", "none"]


def _check_scores(scores: Tensor, temperature: float, reduction: str, what: str) -> None:
    if not isinstance(scores, Tensor) or scores.ndim != 2 or not scores.is_floating_point():
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"{what}: scores must be a float tensor [B, K] (gold in column 0), got {shape}")
    if scores.shape[1] < 2:
        raise ValueError(f"{what}: scores {tuple(scores.shape)} hold no negative; need K >= 2 candidates")
    if not temperature > 0:
        raise ValueError(f"{what}: temperature must be > 0, got {temperature}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{what}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _softmax_nll_of_gold(logits: Tensor, reduction: str) -> Tensor:
    """-log softmax(logits)[:, 0], in at least fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_mention = torch.logsumexp(logits, dim=1) - logits[:, 0]
    if reduction == "mean":
        return per_mention.mean()
    if reduction == "sum":
        return per_mention.sum()
    return per_mention


def nce_loss(scores: Tensor, temperature: float = 1.0, reduction: Reduction = "mean") -> Tensor:
    """Hard-negative NCE, J_HARD: -log softmax(scores / temperature)[:, 0].

    scores: [B, K], gold in column 0. Returns a scalar (or [B] with reduction="none"),
    fp32 for half-precision scores.
    """
    _check_scores(scores, temperature, reduction, "nce_loss")
    return _softmax_nll_of_gold(scores / temperature, reduction)


def check_log_q(log_q: Tensor, what: str = "adjusted_nce_loss") -> None:
    """Raise unless every entry of ``log_q`` is a finite log-probability (<= 0). Reads the values:
    call it where they are on the host (the training step does, before the batch goes to the GPU,
    and then passes ``checked=True``)."""
    if not bool(torch.isfinite(log_q).all()):
        raise ValueError(f"{what}: log_q has non-finite entries (a negative the sampler gave "
                         "probability 0 cannot have been drawn)")
    if bool((log_q > 1e-6).any()):
        raise ValueError(f"{what}: log_q must be log-probabilities (<= 0); max is "
                         f"{float(log_q.max()):.4g} (were probabilities passed instead of their logs?)")


def adjusted_nce_loss(
    scores: Tensor, log_q: Tensor, temperature: float = 1.0, reduction: Reduction = "mean", checked: bool = False
) -> Tensor:
    """Score-adjusted NCE, J_ADJ: negatives' scores lowered by log((K-1) nu(y_k | x, y_1)).

    scores: [B, K], gold in column 0. log_q: [B, K-1], log nu(y_k | x, y_1) of each
    negative under the distribution the sampler drew it from (the log-probability of
    one draw, as the sampler reports it). The correction is a log importance weight,
    so it is applied after the temperature, not divided by it.

    With a uniform nu = 1/(N-1) over N labels this is J_HARD with every negative's score
    raised by the constant c = log((N-1)/(K-1)) (equivalently, the gold's lowered by c):
    each of the K-1 sampled negatives stands for (N-1)/(K-1) labels. When K = N it is
    J_HARD itself.

    ``checked``: the caller ran :func:`check_log_q` on ``log_q``'s host copy, so its values are
    not read here (on a GPU that read waits for the device).
    """
    _check_scores(scores, temperature, reduction, "adjusted_nce_loss")
    b, k = scores.shape
    if not isinstance(log_q, Tensor) or log_q.shape != (b, k - 1):
        shape = tuple(log_q.shape) if isinstance(log_q, Tensor) else type(log_q).__name__
        raise ValueError(f"adjusted_nce_loss: log_q must be [B, K-1] = [{b}, {k - 1}] "
                         f"(one log-probability per negative), got {shape}")
    if not checked:  # checked: the caller ran check_log_q on the host copy
        check_log_q(log_q)
    logits = scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature
    correction = torch.log(torch.tensor(float(k - 1), dtype=logits.dtype, device=logits.device)) + log_q
    logits = torch.cat([logits[:, :1], logits[:, 1:] - correction.to(logits.dtype)], dim=1)
    return _softmax_nll_of_gold(logits, reduction)
