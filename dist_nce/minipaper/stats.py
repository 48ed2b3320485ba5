"""Seeds -> a table cell, and when one arm beats another.

Pure functions over plain numbers. A cell of the table is the mean over seeds with the
range (min, max) beside it; one arm *wins* against another only when its worst seed is
above the other's best seed (the ranges do not overlap), *loses* in the mirror case, and
is a *tie* (no verdict) otherwise. With 3 seeds a separation of the ranges is what a
reader can check by eye, and it is stricter than a difference of means.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence


def spread(values: Iterable[float]) -> dict[str, Any]:
    """{"mean", "min", "max", "std", "n", "values"} over the finite ``values`` (NaN dropped).

    ``std`` is the sample standard deviation (n - 1), 0 for one value; every statistic is
    NaN when no value is finite.
    """
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        nan = math.nan
        return {"mean": nan, "min": nan, "max": nan, "std": nan, "n": 0, "values": []}
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": mean, "min": min(v), "max": max(v), "std": std, "n": len(v), "values": v}


def verdict(a: Mapping[str, Any], b: Mapping[str, Any], min_seeds: int = 2) -> str:
    """"wins" if every seed of ``a`` is above every seed of ``b``, "loses" in the mirror case,
    else "tie" (also when either side has fewer than ``min_seeds`` values: one run is no range)."""
    if a["n"] < min_seeds or b["n"] < min_seeds:
        return "tie"
    if a["min"] > b["max"]:
        return "wins"
    if a["max"] < b["min"]:
        return "loses"
    return "tie"


def separation_chance(n: int, m: int) -> float:
    """The chance that ``n`` values all lie above ``m`` others when every value comes from the same
    distribution (no real difference, ties impossible): every ordering of the n + m values is equally
    likely and n of them must take the top places, 1 / C(n + m, n). 3 seeds against 3: 1 in 20,
    which is a (+) verdict's chance by seed alone; the same again for a (-)."""
    if n < 1 or m < 1:
        raise ValueError(f"separation_chance: need values on both sides, got {n} and {m}")
    return 1.0 / math.comb(n + m, n)


def group(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Rows (one per seed) grouped by ``keys``, each metric reduced by :func:`spread`, in first-seen order."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = tuple(r[x] for x in keys)
        g = out.setdefault(k, {**{x: r[x] for x in keys}, "seeds": [], **{m: [] for m in metrics}})
        g["seeds"].append(r.get("seed"))
        for m in metrics:
            g[m].append(r.get(m, math.nan))
    return [{**{x: g[x] for x in keys}, "seeds": g["seeds"], **{m: spread(g[m]) for m in metrics}}
            for g in out.values()]


def against(groups: Sequence[Mapping[str, Any]], metrics: Sequence[str], by: str = "architecture",
            arm: str = "arm", baseline: str = "random") -> list[dict[str, Any]]:
    """For each group other than the baseline arm: its verdict and mean difference against the
    baseline arm of the same ``by`` value, per metric."""
    base = {g[by]: g for g in groups if g[arm] == baseline}
    out = []
    for g in groups:
        if g[arm] == baseline or g[by] not in base:
            continue
        b = base[g[by]]
        out.append({by: g[by], arm: g[arm], "baseline": baseline,
                    **{m: {"verdict": verdict(g[m], b[m]), "delta_mean": g[m]["mean"] - b[m]["mean"]}
                       for m in metrics}})
    return out


def curve_band(curves: Sequence[Mapping[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Seeds' curves {step: value} -> (steps every seed has, mean, min, max) for a band plot."""
    if not curves:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    cols = [[c[s] for c in curves] for s in steps]
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]
