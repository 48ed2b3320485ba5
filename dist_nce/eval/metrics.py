"""Ranking and linking metrics over arrays, micro- and macro-averaged over worlds.

Notation (all arrays numpy or torch; torch tensors are moved to CPU numpy):

- ``ranked``   int [N, K]  candidate entity ids per mention, best first. ``-1`` is padding
  (fewer than K candidates) and never matches anything, wherever it appears.
- ``gold``     int [N]     the gold entity id per mention. ``-1`` means "gold not in the KB":
  such a mention is *kept* in every denominator where all mentions count (recall@k,
  accuracy, unnormalized accuracy) and is always a miss there. It never has its gold in
  the top k, so it never enters the normalized-accuracy denominator.
- ``worlds``   [N]         any hashable labels (Zeshel world names, ints). Optional.

Definitions (``1[.]`` is the indicator, ``W`` the set of worlds, ``M_w`` the mentions of w):

- hit@k(i)           = 1[gold_i != -1 and gold_i in ranked_i[:min(k, K)]]
- recall@k           = mean_i hit@k(i) over all mentions. With k > K the list has fewer
  than k candidates and all K count (the list is simply shorter than k; no error).
- accuracy           = mean_i 1[gold_i != -1 and pred_i == gold_i] over all mentions.
  ``unnormalized accuracy`` is exactly this (Logeswaran et al. 2019; the paper's Table 2
  "U.Acc."), with pred the reranker's top-1 over the retriever's candidates.
- normalized accuracy = mean over {i : hit@k(i)} of 1[pred_i == gold_i], i.e. accuracy on
  the mentions whose gold the retriever put in its top k (k=64 in the paper). When the
  prediction is chosen among those candidates, U.Acc = N.Acc * recall@k (micro).
- micro              = the mean over all counted mentions pooled together.
- macro              = the unweighted mean over worlds of each world's micro value, the way
  Zeshel results (the paper's Tables 1 and 2) average over domains. A world with an empty
  denominator (possible only for normalized accuracy: no gold in any top k) has no value
  and is left out of the macro mean; it is reported with count 0 in :func:`per_world`.

Ties: :func:`rank_by_score` sorts by score descending and breaks exact ties by the smaller
entity id, so a ranking (and any metric on it) never depends on input order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Literal

import numpy as np

Average = Literal["micro", "macro"]
PAD = -1


def _np(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor; avoid importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _int_array(x: Any, name: str, ndim: int) -> np.ndarray:
    a = _np(x, name)
    if a.ndim != ndim:
        want = "[N]" if ndim == 1 else "[N, K]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: expected integer entity ids, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_n(n: int, **arrays: np.ndarray) -> None:
    for name, a in arrays.items():
        if a.shape[0] != n:
            raise ValueError(f"{name}: expected {n} rows (one per mention), got {a.shape[0]}")
    if n == 0:
        raise ValueError("no mentions: metrics over an empty set are undefined")


def rank_by_score(candidate_ids: Any, scores: Any) -> np.ndarray:
    """Order each row's candidates by score, best first, with a deterministic tie rule.

    Args:
        candidate_ids: int [N, C], ``-1`` = padding.
        scores: float [N, C], the score of each candidate (ignored where padding).

    Returns:
        int64 [N, C]: candidates sorted by score descending; exact ties go to the smaller
        entity id; padding goes last. NaN scores of real candidates are an error.
    """
    ids = _int_array(candidate_ids, "candidate_ids", 2)
    s = _np(scores, "scores").astype(np.float64)
    if s.shape != ids.shape:
        raise ValueError(f"scores: expected shape {tuple(ids.shape)} like candidate_ids, got {tuple(s.shape)}")
    pad = ids == PAD
    if np.isnan(s[~pad]).any():
        row = int(np.nonzero(np.isnan(np.where(pad, 0.0, s)).any(axis=1))[0][0])
        raise ValueError(f"scores: NaN score for a real candidate in row {row}")
    # np.lexsort sorts by the last key first: padding flag, then -score, then id.
    order = np.lexsort((ids, -np.where(pad, 0.0, s), pad), axis=1)
    return np.take_along_axis(ids, order, axis=1)


def hits_at_k(ranked: Any, gold: Any, k: int) -> np.ndarray:
    """bool [N]: gold != -1 and gold in ``ranked[i, :k]`` (all K columns when k > K)."""
    r = _int_array(ranked, "ranked", 2)
    g = _int_array(gold, "gold", 1)
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected a positive integer, got {k!r}")
    _check_n(r.shape[0], gold=g)
    top = r[:, : int(k)]
    return (g != PAD) & (top == g[:, None]).any(axis=1)


def correct(pred: Any, gold: Any) -> np.ndarray:
    """bool [N]: pred == gold and gold != -1 (a -1 prediction is simply wrong)."""
    p = _int_array(pred, "pred", 1)
    g = _int_array(gold, "gold", 1)
    _check_n(p.shape[0], gold=g)
    return (g != PAD) & (p == g)


@dataclass(frozen=True)
class WorldValue:
    """One world's mean over its counted mentions (``nan`` when ``count`` is 0)."""

    value: float
    count: int


def per_world(values: Any, worlds: Any, mask: Any | None = None) -> dict[Hashable, WorldValue]:
    """Per-world mean of ``values`` [N] over the mentions where ``mask`` [N] is true.

    Worlds appear in sorted order of their labels; every world in ``worlds`` is present,
    with count 0 and value nan when the mask selects none of its mentions.
    """
    v = _np(values, "values").astype(np.float64)
    w = _np(worlds, "worlds")
    m = np.ones(v.shape, dtype=bool) if mask is None else _np(mask, "mask").astype(bool)
    if v.ndim != 1 or w.shape != v.shape or m.shape != v.shape:
        raise ValueError(
            f"values, worlds, mask: expected equal shapes [N], got {v.shape}, {w.shape}, {m.shape}"
        )
    labels, inverse = np.unique(w, return_inverse=True)
    sums = np.bincount(inverse, weights=np.where(m, v, 0.0), minlength=len(labels))
    counts = np.bincount(inverse, weights=m.astype(np.float64), minlength=len(labels)).astype(np.int64)
    out: dict[Hashable, WorldValue] = {}
    for label, s, c in zip(labels.tolist(), sums, counts):
        out[label] = WorldValue(float(s / c) if c else float("nan"), int(c))
    return out


def average(values: Any, worlds: Any | None = None, mask: Any | None = None, how: Average = "micro") -> float:
    """Micro or macro mean of ``values`` [N] over the mentions where ``mask`` is true.

    micro: sum(values[mask]) / sum(mask) (nan when nothing is selected).
    macro: unweighted mean over worlds of the per-world micro value; worlds with nothing
    selected are skipped (nan when every world is empty). ``worlds`` is required.
    """
    v = _np(values, "values").astype(np.float64)
    if how == "micro":
        m = np.ones(v.shape, dtype=bool) if mask is None else _np(mask, "mask").astype(bool)
        c = int(m.sum())
        return float(v[m].sum() / c) if c else float("nan")
    if how == "macro":
        if worlds is None:
            raise ValueError("macro average needs worlds [N]")
        vals = [wv.value for wv in per_world(v, worlds, mask).values() if wv.count]
        return float(np.mean(vals)) if vals else float("nan")
    raise ValueError(f"how: expected 'micro' or 'macro', got {how!r}")


def recall_at_k(ranked: Any, gold: Any, k: int, worlds: Any | None = None, how: Average = "micro") -> float:
    """Fraction of all mentions whose gold is in the top k; -1 gold counts as a miss."""
    return average(hits_at_k(ranked, gold, k), worlds, how=how)


def accuracy(pred: Any, gold: Any, worlds: Any | None = None, how: Average = "micro") -> float:
    """Fraction of all mentions with pred == gold; -1 gold counts as a miss.

    This is the unnormalized accuracy when ``pred`` is the reranker's top-1.
    """
    return average(correct(pred, gold), worlds, how=how)


unnormalized_accuracy = accuracy


def normalized_accuracy(
    pred: Any, candidates: Any, gold: Any, k: int, worlds: Any | None = None, how: Average = "micro"
) -> float:
    """Accuracy of ``pred`` [N] over the mentions whose gold is in ``candidates[:, :k]``.

    ``candidates`` int [N, K] is the retriever's ranked list the reranker chose from.
    nan when no mention has its gold in the top k.
    """
    return average(correct(pred, gold), worlds, mask=hits_at_k(candidates, gold, k), how=how)


def linking_report(
    ranked: Any,
    gold: Any,
    worlds: Any,
    ks: tuple[int, ...] = (1, 4, 8, 16, 32, 64),
    pred: Any | None = None,
    k_norm: int = 64,
) -> dict[str, Any]:
    """All metrics at once, JSON-ready: {metric: {"micro", "macro", "per_world": {w: {value, count}}}}.

    ``ranked`` [N, K] is the retriever's list. With ``pred`` [N] (the reranker's choice),
    adds ``accuracy`` (= unnormalized) and ``normalized_accuracy`` at ``k_norm``; without it
    ``accuracy`` is the retriever's own top-1 accuracy. Also reports ``n_mentions`` and
    ``n_gold_not_in_kb`` (gold == -1; counted as misses, never dropped). A k in ``ks`` (or ``k_norm``)
    above K is refused: recall there would repeat recall@K, not measure what was not retrieved.
    """
    r = _int_array(ranked, "ranked", 2)
    g = _int_array(gold, "gold", 1)
    _check_n(r.shape[0], gold=g)
    asked = {*ks, *([k_norm] if pred is not None else [])}
    beyond = sorted(k for k in asked if k > r.shape[1])
    if beyond:
        raise ValueError(f"linking_report: recall@{beyond} needs that many ranked candidates, got K={r.shape[1]}")
    top1 = r[:, 0] if r.shape[1] else np.full(g.shape, PAD)
    p = top1 if pred is None else _int_array(pred, "pred", 1)

    def entry(values: np.ndarray, mask: np.ndarray | None = None) -> dict[str, Any]:
        pw = per_world(values, worlds, mask)
        return {
            "micro": average(values, worlds, mask, "micro"),
            "macro": average(values, worlds, mask, "macro"),
            "per_world": {str(w): {"value": x.value, "count": x.count} for w, x in pw.items()},
        }

    out: dict[str, Any] = {f"recall@{k}": entry(hits_at_k(r, g, k)) for k in ks}
    out["accuracy"] = entry(correct(p, g))
    if pred is not None:
        out[f"normalized_accuracy@{k_norm}"] = entry(correct(p, g), hits_at_k(r, g, k_norm))
    out["n_mentions"] = int(g.shape[0])
    out["n_gold_not_in_kb"] = int((g == PAD).sum())
    return out
