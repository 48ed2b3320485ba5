"""Statistical helpers of the sampler law tests (test_block_native, test_block_fused, and
benchmarks/gpu.py's GPU law checks): chi-square p-values and exact inclusion probabilities."""
from __future__ import annotations

import torch


def _gamma_q(dof: int, stat: float) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_p(observed: torch.Tensor, expected: torch.Tensor, pool_below: float = 5.0) -> float:
    """Pearson chi-square p-value, cells expecting fewer than ``pool_below`` pooled into one."""
    small = expected < pool_below
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _gamma_q(int(keep.sum()) - 1, stat)


def two_sample_p(a: torch.Tensor, b: torch.Tensor, cells: int) -> float:
    """Chi-square p-value that two equal-sized samples of cell ids [n] in [0, cells) share a law
    (cells with fewer than 10 draws in both pooled)."""
    x = torch.bincount(a, minlength=cells).double()
    y = torch.bincount(b, minlength=cells).double()
    big = (x + y) >= 10
    x = torch.cat([x[big], x[~big].sum().view(1)])
    y = torch.cat([y[big], y[~big].sum().view(1)])
    stat = float(((x - y) ** 2 / (x + y).clamp(min=1)).sum())
    return _gamma_q(int(big.sum()), stat)


def inclusion3(p: torch.Tensor) -> torch.Tensor:
    """Inclusion probabilities of 3 successive draws without replacement from p [n], exactly:
    P(i, j, l) = p_i p_j / (1 - p_i) p_l / (1 - p_i - p_j) summed over the orders."""
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
    """How draws ``ids`` [draws, >= 3] (rows 1..n-1 of scores ``s`` [n], row 0 the gold) fit K-1 = 3
    successive draws without replacement proportional to exp(s): chi-square p-values of the first draw
    and of the ordered pair of the first two (p_i p_j / (1 - p_i)), the pair test's p-value against the
    same law at ``temperature`` (a negative control that must reject), and the largest |z| of the
    inclusion probabilities."""
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
