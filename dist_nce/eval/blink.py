"""BLINK's benchmark table over linked mentions, counted the way BLINK counts it.

BLINK's ``blink/run_benchmark.py`` (``blink/main_dense.py``, read at BLINK 5fe254d) scores the files its
``scripts/create_BLINK_benchmark_data.py`` writes (AIDA-YAGO2 testa/testb, ACE 2004, AQUAINT, ...), one
mention per line with ``label_id`` its Wikipedia page id, in a table of five columns. Its counting differs
from KILT's and from :mod:`dist_nce.eval.metrics` in three places, all kept here so that a number set beside
BLINK's paper table means the same:

- a mention whose ``label_id`` is not an integer, or not a page of the KB, is dropped: ``support`` counts
  the others and every column is over them (KILT and ``metrics`` keep such a mention, as a miss);
- "recall at 100" is BLINK's loop ``for i in range(1, top_k)``: the recall of the first top_k - 1
  candidates (99 of 100). The table keeps BLINK's name for it; ``recall@k`` (all k) is reported beside it;
- the cross-encoder's "normalized accuracy" is its top 1 over the mentions whose gold is among all k
  candidates; "overall unnormalized accuracy" is that times their share of ``support``.

Gold and candidates are compared as store rows (a page id names one live row).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dist_nce.eval.metrics import PAD, average, correct, hits_at_k

# BLINK's own column names (run_benchmark.py's table, its spelling kept)
COLUMNS = ("biencoder accuracy", "recall at 100", "crossencoder normalized accuracy",
           "overall unormalized accuracy", "support")


def page_id(label: Any) -> str | None:
    """BLINK's reading of a ``label_id`` (``int(str(label).strip())``) as a store source id; None where
    BLINK's would raise (the mention is dropped there)."""
    text = str(label).strip()
    try:
        return str(int(text))
    except ValueError:
        return None


def blink_scores(ranked: Any, gold: Any, reranked_top1: Any | None = None) -> dict[str, Any]:
    """BLINK's table for ``ranked`` int [N, k] (the retriever's candidates, best first, store rows) against
    ``gold`` int [N] (the gold's row, -1: not an integer page id or not in the KB: dropped), and with
    ``reranked_top1`` int [N] (the cross-encoder's choice among the row's candidates) its two columns.

    Returns ``{"lines": N, "support": S, "k": k, "recall@k": ..., "table": {BLINK's column: value}}``;
    a column BLINK would print as -1 (no cross-encoder, k < 2, nothing supported) is None.
    """
    r = np.asarray(ranked, dtype=np.int64)
    g = np.asarray(gold, dtype=np.int64)
    if r.ndim != 2 or g.shape != (r.shape[0],):
        raise ValueError(f"ranked [N, k] and gold [N]: got shapes {r.shape} and {g.shape}")
    kept = g != PAD
    r, g = r[kept], g[kept]
    n, k = len(g), r.shape[1]

    def mean(values: np.ndarray, mask: np.ndarray | None = None) -> float | None:
        v = average(values, mask=mask)
        return None if np.isnan(v) else v

    table: dict[str, Any] = dict.fromkeys(COLUMNS)
    table["support"] = n
    out: dict[str, Any] = {"lines": int(len(kept)), "support": n, "k": k, f"recall@{k}": None, "table": table}
    if n == 0 or k == 0:
        return out
    inside = hits_at_k(r, g, k)  # gold among all k candidates
    out[f"recall@{k}"] = mean(inside)
    table["biencoder accuracy"] = mean(hits_at_k(r, g, 1))
    if k >= 2:
        table["recall at 100"] = mean(hits_at_k(r, g, k - 1))
    if reranked_top1 is not None:
        p = np.asarray(reranked_top1, dtype=np.int64)
        if p.shape != kept.shape:
            raise ValueError(f"reranked_top1 [N]: got shape {p.shape}, expected {kept.shape}")
        normalized = mean(correct(p[kept], g), mask=inside)
        table["crossencoder normalized accuracy"] = normalized
        if normalized is not None:
            table["overall unormalized accuracy"] = normalized * int(inside.sum()) / n
    return out


def linked_rows(entities: Sequence[dict]) -> tuple[list[int], int | None]:
    """One linked mention's entities (``Linker.answers``: best first, by reranker score when there is one)
    -> (its store rows in the retriever's order, the reranker's top row or None)."""
    if not entities:
        return [], None
    if "rerank_score" not in entities[0]:
        return [int(e["row"]) for e in entities], None
    # the retriever's order again: by its score, descending (exact ties keep the reranked order)
    order = sorted(range(len(entities)), key=lambda j: -float(entities[j]["score"]))
    return [int(entities[j]["row"]) for j in order], int(entities[0]["row"])


def format_table(name: str, scores: dict[str, Any]) -> str:
    """BLINK's table row for one dataset, its columns named (``-`` where BLINK prints -1)."""
    def cell(v: Any, count: bool = False) -> str:
        return "-" if v is None else str(v) if count else f"{v:.4f}"

    key = f"recall@{scores['k']}"
    cells = [f"{c}: {cell(v, c == 'support')}" for c, v in scores["table"].items()]
    return f"{name}: " + ", ".join(cells) + f" ({key}: {cell(scores[key])})"
