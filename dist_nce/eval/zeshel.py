"""Zeshel evaluation: retriever recall per world, candidate files, reranker accuracy.

Retriever recall@k (k = 64 in the paper) is reported under two clearly named settings:

* ``own_world``: each mention is searched among the entities of ITS OWN world only (the
  row range ``EntityStore.world_ranges()[world]``). This is the Zeshel protocol
  (Logeswaran et al., 2019), the one the paper's retrievers and reranker follow.
* ``split_union``: each mention is searched among all entities of its split's worlds
  (e.g. the 4 val worlds together): harder, and a check that a retriever does not
  merely rely on the world restriction.

Both come micro (all mentions pooled) and macro (unweighted mean over worlds, as Zeshel
tables average over domains), with per-world values; definitions in
:mod:`dist_nce.eval.metrics`. One pass does both: every mention is searched in each
world's index, its own world's answer is the ``own_world`` one and the merge of all
of them is the ``split_union`` one (the union's top k = the merge of the parts' top k).

Candidate files hold a retriever's top 64 for the reranker, one JSON line per mention:
``{"mention_id": ..., "candidates": [document_id, ...]}`` best first. Zeshel's own
``tfidf_candidates/<split>.json`` (``{"mention_id": ..., "tfidf_candidates": [...]}``)
read the same way, so the reranker also runs on BM25-style candidates.

Reranker accuracy (the paper's Table 2, Appendix B): unnormalized accuracy over all
mentions and normalized accuracy over the mentions whose gold is among the candidates,
macro over the worlds of val and test.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dist_nce.core.artifacts import atomic_path
from dist_nce.eval.metrics import PAD, linking_report
from dist_nce.index.config import IndexConfig
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.retriever import Retriever
from dist_nce.retrieval import Retrieved, build_local_index, iter_mention_reps, ranked_source_ids
from dist_nce.sampling.topk import merge_results
from kb.store import EntityStore, MentionTable
from kb.zeshel import ZESHEL_SPLITS, worlds_for_split

CANDIDATES_KEY = "candidates"
CANDIDATES_KIND = "zeshel_candidates"  # the manifest of a retriever's candidates directory (zeshel.evaluate)
TFIDF_KEY = "tfidf_candidates"
RECALL_KS = (1, 4, 8, 16, 32, 64)


def recall_ks(k: int) -> list[int]:
    """The recall cut-offs reported for a top-``k`` list: :data:`RECALL_KS` up to ``k``, and ``k``. Above k
    the list has nothing more to find: recall@32 of a top-16 list would repeat recall@16 as if measured."""
    return sorted({*(x for x in RECALL_KS if x <= k), k})


class CandidateFileError(ValueError):
    """A malformed candidates file, or one that does not cover the mentions."""


# --------------------------------------------------------------------------- retriever recall


def split_world_ranges(store: EntityStore, mentions: MentionTable) -> dict[str, tuple[int, int]]:
    """World -> row range for the worlds of ``mentions.split`` that are in ``store``.

    The split's worlds are its standard Zeshel worlds present in the store plus any world
    a mention names; a mention whose world has no entities is an error.
    """
    ranges = store.world_ranges()
    if not ranges:
        raise ValueError(f"{store.path}: the store's manifest lists no worlds; not a prepared Zeshel KB")
    labels = mentions.worlds
    named = set(labels)
    if None in named:
        raise ValueError(f"{mentions.path} split {mentions.split!r}: mention {labels.index(None)} has no world")
    absent = sorted(named - set(ranges))
    if absent:
        raise ValueError(f"{mentions.path} split {mentions.split!r}: no entities for worlds {absent} in {store.path}")
    standard = set(worlds_for_split(mentions.split)) if mentions.split in ZESHEL_SPLITS else set()
    return {w: ranges[w] for w in sorted((named | standard) & set(ranges))}


def build_world_indexes(
    retriever: Retriever, store: EntityStore, ranges: Mapping[str, tuple[int, int]], config: IndexConfig | None = None,
    batch_size: int = 256, progress: bool = True,
) -> dict[str, ShardIndex]:
    """One in-process index per world (its rows encoded once), all held at once: for SOM
    that is rows x entity_max_len x d values in the storage dtype, so large splits want a GPU.

    In process because ``NegativeService.topk`` searches the whole KB and cannot be
    restricted to a world's rows; Zeshel worlds are small (10k-35k entities)."""
    return {w: build_local_index(retriever, store, config, rows=ab, batch_size=batch_size, progress=progress)
            for w, ab in ranges.items()}


@dataclass(frozen=True)
class WorldRetrieval:
    """``own``: each mention's top k within its world; ``union``: within all ``indexes``' worlds."""

    own: Retrieved
    union: Retrieved
    worlds: list[str]


def retrieve_worlds(
    retriever: Retriever, mentions: MentionTable, indexes: Mapping[str, ShardIndex], k: int = 64, batch_size: int = 128,
    progress: bool = True,
) -> WorldRetrieval:
    """Top k of every mention in its own world and in the union of the worlds (one encode)."""
    names = list(indexes)
    labels = list(mentions.worlds)
    slot = {w: i for i, w in enumerate(names)}
    missing = sorted({w for w in labels if w not in slot}, key=str)
    if missing:
        raise ValueError(f"mentions of worlds {missing} but indexes only for {names}")
    world_of = np.array([slot[w] for w in labels], dtype=np.int64)
    n = len(labels)
    out = {name: (np.full((n, k), PAD, np.int64), np.full((n, k), -np.inf, np.float32)) for name in ("own", "union")}
    versions: set[int] = set()
    desc = f"retrieve {getattr(mentions, 'split', '')} ({len(names)} worlds)"
    for idx, q in iter_mention_reps(retriever, mentions, None, batch_size, progress, desc):
        parts = [indexes[w].topk(q, k) for w in names]
        union = merge_results(parts, k)
        pick = (torch.from_numpy(world_of[idx]), torch.arange(len(idx)))
        for name, ids, scores in (("own", torch.stack([p.ids for p in parts])[pick],
                                   torch.stack([p.scores for p in parts])[pick]),
                                  ("union", union.ids, union.scores)):
            out[name][0][idx] = ids.numpy()
            out[name][1][idx] = scores.float().numpy()
        versions.update(p.version for p in parts)
    v = tuple(sorted(versions))
    return WorldRetrieval(Retrieved(*out["own"], v), Retrieved(*out["union"], v), labels)


def recall_report(result: WorldRetrieval, gold: np.ndarray, ks: Sequence[int] = RECALL_KS) -> dict[str, Any]:
    """{"own_world": linking_report, "split_union": linking_report}: recall@k (and top-1
    accuracy) micro/macro/per world; gold -1 (not in the KB) counts as a miss."""
    return {"own_world": linking_report(result.own.rows, gold, result.worlds, tuple(ks)),
            "split_union": linking_report(result.union.rows, gold, result.worlds, tuple(ks))}


# --------------------------------------------------------------------------- candidate files


def write_candidates(path: str | Path, mention_ids: Sequence[str], candidates: Sequence[Sequence[str]]) -> None:
    """Write ``{"mention_id", "candidates"}`` lines atomically, in the order given."""
    if len(mention_ids) != len(candidates):
        raise ValueError(f"{path}: {len(mention_ids)} mention ids but {len(candidates)} candidate lists")
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for mid, docs in zip(mention_ids, candidates):
                f.write(json.dumps({"mention_id": mid, CANDIDATES_KEY: list(docs)}) + "\n")


def read_candidates(path: str | Path, key: str = CANDIDATES_KEY) -> dict[str, list[str]]:
    """mention_id -> ranked document ids, from lines ``{"mention_id": ..., key: [...]}``."""
    out: dict[str, list[str]] = {}
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CandidateFileError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("mention_id"), str):
                raise CandidateFileError(f"{where}: expected an object with a string 'mention_id'")
            docs = obj.get(key)
            if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
                raise CandidateFileError(f"{where}: expected '{key}': a list of document id strings")
            mid = obj["mention_id"]
            if mid in out:
                raise CandidateFileError(f"{where}: mention_id {mid!r} again (first at line {first_line[mid]})")
            out[mid], first_line[mid] = docs, lineno
    return out


def read_tfidf_candidates(path: str | Path) -> dict[str, list[str]]:
    """Zeshel's ``tfidf_candidates/<split>.json``: mention_id -> ranked document ids."""
    return read_candidates(path, TFIDF_KEY)


@dataclass(frozen=True)
class CandidateSet:
    """Candidates of N mentions as store rows, for the reranker.

    rows: int64 [N, k], best first, -1 = empty. gold_pos: int64 [N], the gold's column in
    ``rows`` or -1. Counts: gold not among the candidates (gold missing from the KB
    included), gold missing from the KB, candidate ids unknown to the KB (dropped),
    mentions in the file but not in the table (ignored), lists longer than k (cut).
    """

    rows: np.ndarray
    gold_pos: np.ndarray
    n_gold_not_in_candidates: int
    n_gold_not_in_kb: int
    n_unknown_documents: int
    n_extra_mentions: int
    n_truncated: int

    def counts(self) -> dict[str, int]:
        return {"n_mentions": int(len(self.gold_pos)), "n_gold_not_in_candidates": self.n_gold_not_in_candidates,
                "n_gold_not_in_kb": self.n_gold_not_in_kb, "n_unknown_documents": self.n_unknown_documents,
                "n_extra_mentions": self.n_extra_mentions, "n_truncated_lists": self.n_truncated}


def candidate_rows(
    candidates: Mapping[str, Sequence[str]], mentions: MentionTable, store: EntityStore, k: int = 64,
    source: str = "candidates",
) -> CandidateSet:
    """Map each table mention's candidate document ids to store rows ([N, k]) and find its gold.

    Every mention of the table needs a line (else :class:`CandidateFileError`, naming
    ``source`` and the first missing ids); document ids the KB lacks are dropped and counted.
    """
    mids = mentions.mention_ids
    lacking = [m for m in mids if m not in candidates]
    if lacking:
        raise CandidateFileError(f"{source}: no candidates for {len(lacking)} of {len(mids)} mentions of split "
                                 f"{getattr(mentions, 'split', '?')!r}, e.g. {lacking[:3]}")
    lists = [list(candidates[m]) for m in mids]
    flat = [d for docs in lists for d in docs]
    found = store.rows_for_source_ids(flat) if flat else np.zeros(0, np.int64)
    rows = np.full((len(mids), k), PAD, dtype=np.int64)
    start = truncated = 0
    for i, docs in enumerate(lists):
        mapped = found[start:start + len(docs)]
        start += len(docs)
        mapped = mapped[mapped >= 0]
        truncated += len(mapped) > k
        rows[i, :min(k, len(mapped))] = mapped[:k]
    gold = np.asarray(mentions.gold_rows, dtype=np.int64)
    hit = (rows == gold[:, None]) & (gold[:, None] >= 0)
    gold_pos = np.where(hit.any(axis=1), hit.argmax(axis=1), -1)
    return CandidateSet(rows, gold_pos, int((gold_pos < 0).sum()), int((gold < 0).sum()), int((found < 0).sum()),
                        len(set(candidates) - set(mids)), int(truncated))


# --------------------------------------------------------------------------- reranker


def rerank(
    reranker: Any, mentions: MentionTable, store: EntityStore, rows: np.ndarray, batch_size: int = 2,
    progress: bool = True,
) -> np.ndarray:
    """The reranker's choice among each mention's candidate rows [N, k] -> int64 [N] rows.

    Empty slots (-1) never win; a mention without candidates gets -1. Exact score ties go
    to the earlier (better retrieved) candidate.
    """
    from tqdm.auto import tqdm

    rows = np.asarray(rows, dtype=np.int64)
    pred = np.full(rows.shape[0], PAD, dtype=np.int64)
    reranker.eval()
    for start in tqdm(range(0, rows.shape[0], batch_size), desc=f"rerank {getattr(mentions, 'split', '')}",
                      unit="batch", disable=not progress, mininterval=2.0):
        idx = np.arange(start, min(start + batch_size, rows.shape[0]))
        cand = rows[idx]
        m_ids = torch.from_numpy(mentions.token_ids(idx).astype(np.int64))
        e_ids = torch.from_numpy(store.token_ids(np.where(cand >= 0, cand, 0)).astype(np.int64))
        with torch.inference_mode():
            scores = reranker.score(m_ids, e_ids).float().cpu()
        scores = scores.masked_fill(torch.from_numpy(cand < 0), float("-inf"))
        best = scores.argmax(dim=1).numpy()  # first maximum: the earlier candidate
        pred[idx] = np.where((cand >= 0).any(axis=1), cand[np.arange(len(idx)), best], PAD)
    return pred


def reranker_report(pred: np.ndarray, cands: CandidateSet, gold: np.ndarray, worlds: Sequence[str],
                    k: int = 64) -> dict[str, Any]:
    """Unnormalized / normalized accuracy (micro, macro over worlds, per world), the
    candidates' recall@k, the retriever's own accuracy on the same mentions (``retriever_recall@1``:
    its first candidate is the gold; the reranker helps where its unnormalized accuracy is higher),
    and the counts of :class:`CandidateSet`."""
    rep = linking_report(cands.rows, gold, list(worlds), ks=tuple(sorted({1, k})), pred=pred, k_norm=k)
    return {"unnormalized_accuracy": rep["accuracy"], "normalized_accuracy": rep[f"normalized_accuracy@{k}"],
            f"candidate_recall@{k}": rep[f"recall@{k}"], "retriever_recall@1": rep["recall@1"], **cands.counts()}


# The keys of every line write_predictions writes, in its order (the predictions manifest lists them).
PREDICTION_FIELDS = ("mention_id", "world", "gold", "gold_label", "prediction", "gold_rank", "correct")


def write_predictions(path: str | Path, pred: np.ndarray, cands: CandidateSet, mentions: MentionTable,
                      store: EntityStore) -> None:
    """The reranker's choice per mention as JSONL, in the table's order, written atomically: ``mention_id``,
    ``world``, ``gold`` and ``prediction`` (document ids; null: no gold in the KB / no candidate chosen, which
    includes a mention whose gold is not among its candidates: evaluation does not rerank those, being wrong
    whatever the choice), ``gold_label`` (the document id the mention is labelled with, also where that
    document is not in the KB),
    ``gold_rank`` (the gold's 0-based place among the candidates, -1 if absent) and ``correct``. Enough to
    recompute U.Acc and N.Acc (:func:`reranker_report`) and to pair two systems mention by mention.

    pred: int64 [N] store rows (-1 none); cands: the [N, k] candidates it chose among.
    """
    gold = np.asarray(mentions.gold_rows, dtype=np.int64)
    if not len(pred) == len(gold) == len(cands.gold_pos):
        raise ValueError(f"{path}: {len(pred)} predictions for {len(gold)} mentions")
    ids = lambda rows: store.source_ids(np.maximum(rows, 0)) if len(rows) else []  # noqa: E731
    gold_ids, pred_ids = ids(gold), ids(np.asarray(pred, dtype=np.int64))
    labels = mentions.table.column("gold_source_id").to_pylist()
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, (mid, world) in enumerate(zip(mentions.mention_ids, mentions.worlds)):
                f.write(json.dumps({
                    "mention_id": mid, "world": world, "gold": gold_ids[i] if gold[i] >= 0 else None,
                    "gold_label": labels[i],
                    "prediction": pred_ids[i] if pred[i] >= 0 else None, "gold_rank": int(cands.gold_pos[i]),
                    "correct": bool(gold[i] >= 0 and pred[i] == gold[i])}) + "\n")


# --------------------------------------------------------------------------- one split, end to end


def evaluate_retriever_split(
    retriever: Retriever, store: EntityStore, mentions: MentionTable, k: int = 64,
    candidates_path: str | Path | None = None,
    index_config: IndexConfig | None = None, batch_size: int = 128, progress: bool = True,
) -> dict[str, Any]:
    """Recall of one split (own world and split union) and, with ``candidates_path``, the
    own-world top k written as the reranker's candidates file."""
    ranges = split_world_ranges(store, mentions)
    indexes = build_world_indexes(retriever, store, ranges, index_config, progress=progress)
    result = retrieve_worlds(retriever, mentions, indexes, k, batch_size, progress)
    if candidates_path is not None:
        write_candidates(candidates_path, mentions.mention_ids, ranked_source_ids(store, result.own.rows))
    return {"split": mentions.split, "k": k, "worlds": {w: list(ab) for w, ab in ranges.items()},
            **recall_report(result, mentions.gold_rows, recall_ks(k))}


def evaluate_reranker_split(
    reranker: Any, store: EntityStore, mentions: MentionTable, candidates: Mapping[str, Sequence[str]], k: int = 64,
    source: str = "candidates", batch_size: int = 2, progress: bool = True,
) -> dict[str, Any]:
    """Reranker accuracy on one split over its candidates (a retriever's or Zeshel's TF-IDF)."""
    cands = candidate_rows(candidates, mentions, store, k, source)
    pred = rerank(reranker, mentions, store, cands.rows, batch_size, progress)
    return {"split": mentions.split, "candidates": str(source),
            **reranker_report(pred, cands, mentions.gold_rows, mentions.worlds, k)}
