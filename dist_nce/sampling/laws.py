"""The statistics that check a sampler's law: chi-square p-values and the exact law of successive
draws without replacement.

A sampler here is exact when its draws follow successive sampling proportional to exp(score). These
functions say how far a batch of draws is from that law. tests/sampling checks the block samplers on
a CPU with them, and ``benchmarks.gpu``'s law section checks them on the device. They live in the
package, not under tests/, because the GPU machine gets the package and benchmarks/ but not tests/.
They are pure torch, in float64, with nothing of the project imported.
"""
from __future__ import annotations

import torch


def _gamma_q(dof: int, stat: float) -> float:
    """P(chi2 with ``dof`` degrees of freedom >= ``stat``): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_p(observed: torch.Tensor, expected: torch.Tensor, pool_below: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``observed`` counts [cells] against ``expected``
    counts [cells] (same total).

    Cells expecting fewer than ``pool_below`` draws are pooled into one cell, where the chi-square
    approximation would not hold. Cells expecting nothing are dropped. Degrees of freedom: cells kept - 1.
    """
    small = expected < pool_below
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _gamma_q(int(keep.sum()) - 1, stat)


def two_sample_p(a: torch.Tensor, b: torch.Tensor, cells: int) -> float:
    """Chi-square p-value that two samples of the same size share one law. ``a`` and ``b`` are [n]
    int64 cell ids in [0, cells).

    Statistic: sum over cells of (x - y)^2 / (x + y), where x and y are the two samples' counts. Cells
    with fewer than 10 draws in both samples together are pooled into one cell. Degrees of freedom:
    the unpooled cells plus the pooled one, minus 1.
    """
    x = torch.bincount(a, minlength=cells).double()
    y = torch.bincount(b, minlength=cells).double()
    big = (x + y) >= 10
    x = torch.cat([x[big], x[~big].sum().view(1)])
    y = torch.cat([y[big], y[~big].sum().view(1)])
    stat = float(((x - y) ** 2 / (x + y).clamp(min=1)).sum())
    return _gamma_q(int(big.sum()), stat)


def inclusion3(p: torch.Tensor) -> torch.Tensor:
    """Exact inclusion probabilities [n] float64 of 3 successive draws without replacement from the
    law ``p`` [n] (positive, summing to 1): P(i in the sample), summed over every order in which i can
    be drawn. An ordered triple (i, j, l) has probability p_i * p_j / (1 - p_i) * p_l / (1 - p_i - p_j).
    The entries sum to 3. O(n^2) Python steps, meant for a few dozen rows."""
    n = p.numel()
    pi = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        pi[i] += p[i]
        for j in range(n):
            if j == i:
                continue
            pj = p[i] * p[j] / (1 - p[i])
            pi[j] += pj
            third = p / (1 - p[i] - p[j]) * pj
            third[i] = third[j] = 0
            pi += third
    return pi


def successive_law(ids: torch.Tensor, s: torch.Tensor, temperature: float) -> dict:
    """How well the draws ``ids`` [draws, >= 3] int64 fit K-1 = 3 successive draws without replacement
    proportional to exp(s). ``s`` [n] holds the scores of rows 0..n-1. Row 0 is the gold, never drawn,
    so ``ids`` hold rows 1..n-1, first draw first.

    Returns the float entries:

    * ``first_draw_p``: chi-square p-value of the first draw against softmax(s[1:]);
    * ``ordered_pairs_p``: chi-square p-value of the ordered pair of the first two draws against
      p_i p_j / (1 - p_i);
    * ``wrong_temperature_p``: the same pair test against the law at ``temperature``, a negative
      control: with enough draws it must reject;
    * ``inclusion_max_z``: the largest |z| of each row's inclusion frequency against
      :func:`inclusion3`, over rows, using each row's binomial standard error.
    """
    draws, n = ids.shape[0], s.numel()
    p = torch.softmax(s[1:].double(), 0)

    def pairs(q: torch.Tensor) -> torch.Tensor:
        return (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0).flatten()
    first = torch.bincount(ids[:, 0] - 1, minlength=n - 1).double()
    counts = torch.bincount((ids[:, 0] - 1) * (n - 1) + (ids[:, 1] - 1), minlength=(n - 1) ** 2).double()
    freq = torch.stack([(ids == i + 1).any(1).double().mean() for i in range(n - 1)])
    pi = inclusion3(p)
    return {"first_draw_p": chi2_p(first, draws * p),
            "ordered_pairs_p": chi2_p(counts, draws * pairs(p)),
            "wrong_temperature_p": chi2_p(counts, draws * pairs(torch.softmax(s[1:].double() / temperature, 0))),
            "inclusion_max_z": float(((freq - pi).abs() / torch.sqrt(pi * (1 - pi) / draws)).max())}
