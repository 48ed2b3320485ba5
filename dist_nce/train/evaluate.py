"""Dev evaluation during and after training: recall@k and accuracy over ALL entities.

Mentions are encoded with the current mention encoder and searched by ``service.topk``
over every shard (``retrieval.retrieve``; exact for the torch/flat backends). A
retriever's accuracy is its top-1 (``eval.metrics.accuracy``); mentions whose gold is not
in the KB stay in every denominator as misses (the metrics module's convention).

With several workers each ranks an equal-length contiguous slice of the mentions (the
last ones padded with other ranks' mentions, so every rank runs the same number of
encoder forwards, which ZeRO-3's parameter gathering requires) and rank 0 gathers.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from dist_nce.actors.protocols import NegativeSource
from dist_nce.eval.metrics import accuracy, recall_at_k
from dist_nce.retrieval import Mentions, retrieve


def dev_metrics(ranked: np.ndarray, gold: np.ndarray, ks: Sequence[int]) -> dict[str, Any]:
    """ranked [N, k] entity rows best first, gold [N] (-1 = not in KB) -> JSON-ready metrics."""
    out: dict[str, Any] = {f"recall@{k}": recall_at_k(ranked, gold, k) for k in ks}
    out["accuracy"] = accuracy(ranked[:, 0], gold)
    out["n_mentions"] = int(len(gold))
    out["n_gold_not_in_kb"] = int((np.asarray(gold) < 0).sum())
    return out


def rank_slice(indices: np.ndarray, rank: int, world: int) -> tuple[np.ndarray, int]:
    """(rank's contiguous chunk of ``indices`` padded to ceil(n / world), its real length).

    A short chunk (the last ranks') is padded with the first mentions of rank 0's chunk:
    distinct from its own, so a ranking keyed by mention index stays unambiguous."""
    size = -(-len(indices) // world)
    part = indices[rank * size:(rank + 1) * size]
    n_real = len(part)
    if n_real < size:
        part = np.concatenate([part, indices[:size - n_real]])
    return part, n_real


def evaluate(module: torch.nn.Module, mentions: Mentions, indices: np.ndarray, service: NegativeSource,
             ks: Sequence[int], batch_size: int, rank: int = 0, world: int = 1,
             all_gather: Callable[[Any], list[Any]] | None = None) -> dict[str, Any] | None:
    """Metrics of ``mentions`` (a MentionTable) at ``indices``; every rank calls it, rank 0 gets them.

    ``module`` is the retriever being trained (its mode is restored afterwards);
    ``all_gather(obj) -> [obj of each rank]`` is needed when world > 1.
    """
    k = max(ks)
    mine, n_real = rank_slice(indices, rank, world)
    was_training = module.training
    try:
        got = retrieve(module, mentions, service, k, indices=mine, batch_size=batch_size, progress=False)
    finally:
        module.train(was_training)
    part = (got.rows[:n_real], got.versions)
    if world > 1:
        if all_gather is None:
            raise ValueError("evaluate: world > 1 needs all_gather")
        parts = all_gather(part)
    else:
        parts = [part]
    if rank != 0:
        return None
    ranked = np.concatenate([rows for rows, _ in parts])
    assert len(ranked) == len(indices), (len(ranked), len(indices))
    out = dev_metrics(ranked, np.asarray(mentions.gold_rows)[indices], ks)
    versions = sorted({v for _, vs in parts for v in vs})
    out["index_version"] = versions[0] if versions else -1
    return out
