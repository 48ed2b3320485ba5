"""After training: top-k recall on the Zeshel splits and the reranker's candidates files.

* Evaluated splits (``zeshel.eval_splits``, val and test) get recall@k under both settings
  of :mod:`dist_nce.eval.zeshel`, each labelled: ``own_world`` (each mention searched
  among its own world's entities: the Zeshel protocol, the paper's Table 1) and
  ``split_union`` (among all entities of the split's worlds), micro and macro over worlds.
* Candidate splits (``zeshel.candidate_splits``, train/val/test) get
  ``candidates_<split>.json``: each mention's own-world top k as document ids, best first,
  the layout the paper's reranker code reads. A split that is not also evaluated (train)
  is searched one world at a time, so only one world's index is in memory (SOM keeps
  every token vector of its entities).

Search is exact and in process (``retrieval.build_local_index``: faiss flat for
dual/multi-m, the chunked torch path for poly-m and SOM).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from dist_nce.core.artifacts import write_manifest
from dist_nce.eval.metrics import PAD, linking_report
from dist_nce.eval.zeshel import (CANDIDATES_KIND, evaluate_retriever_split, recall_ks, split_world_ranges,
                                  write_candidates)
from dist_nce.index.config import IndexConfig
from dist_nce.index.encode import store_fingerprint
from dist_nce.modeling.retriever import Retriever
from dist_nce.modeling.scoring import is_inner_product
from dist_nce.retrieval import build_local_index, default_index_config, ranked_source_ids, retrieve
from dist_nce.zeshel.config import TRAIN_STORE_SPLITS, ZeshelConfig
from kb.store import EntityStore, MentionTable

SETTINGS = ("own_world", "split_union")


def candidates_file(split: str) -> str:
    return f"candidates_{split}.json"


def index_config(retriever: Retriever, backend: str) -> IndexConfig:
    """``auto``: exact faiss flat for inner-product presets, exact torch otherwise."""
    if backend == "auto":
        return default_index_config(retriever)
    if backend != "torch" and not is_inner_product(retriever.spec):
        raise ValueError(f"zeshel.eval_backend={backend!r} serves inner products only; preset "
                         f"{retriever.config.preset!r} needs 'torch' (or 'auto')")
    return IndexConfig(backend=backend)


def own_world_topk(retriever: Retriever, store: EntityStore, mentions: MentionTable, k: int, config: IndexConfig,
                   batch_size: int = 128, progress: bool = True) -> np.ndarray:
    """[N, k] entity rows: every mention's top k among its own world's entities, one world at a time."""
    worlds = np.asarray(mentions.worlds, dtype=object)
    rows = np.full((len(worlds), k), PAD, dtype=np.int64)
    for world, (a, b) in split_world_ranges(store, mentions).items():
        idx = np.flatnonzero(worlds == world)
        if len(idx) == 0:
            continue
        index = build_local_index(retriever, store, config, rows=(a, b), progress=progress)
        got = retrieve(retriever, mentions, index, min(k, b - a), indices=idx, batch_size=batch_size,
                       progress=progress, desc=f"retrieve {mentions.split} {world}")
        rows[idx, :got.rows.shape[1]] = got.rows
    return rows


def evaluate_split(retriever: Retriever, store: EntityStore, mentions: MentionTable, k: int, config: IndexConfig, union: bool,
                   candidates_path: str | Path | None, batch_size: int = 128, progress: bool = True
                   ) -> dict[str, Any]:
    """Recall@k of one split (own world; with ``union`` also split union), and its candidates file."""
    if union:
        return evaluate_retriever_split(retriever, store, mentions, k, candidates_path, config, batch_size, progress)
    rows = own_world_topk(retriever, store, mentions, k, config, batch_size, progress)
    if candidates_path is not None:
        write_candidates(candidates_path, mentions.mention_ids, ranked_source_ids(store, rows))
    ks = recall_ks(k)
    return {"split": mentions.split, "k": k,
            "worlds": {w: list(ab) for w, ab in split_world_ranges(store, mentions).items()},
            "own_world": linking_report(rows, mentions.gold_rows, list(mentions.worlds), tuple(ks))}


def evaluate_retriever(retriever: Retriever, train_store: str, eval_store: str, z: ZeshelConfig,
                       candidates_dir: str | Path, progress: bool = True,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every split of ``z.eval_splits`` and ``z.candidate_splits``; returns {split: report}.

    Train-world splits are read from ``train_store``, the others from ``eval_store``.
    Writes ``candidates_<split>.json`` and a manifest into ``candidates_dir``.
    """
    from kb.store import EntityStore, MentionTable

    from dist_nce.core.text import tokenizer_fingerprint

    sha = tokenizer_fingerprint(retriever.tokenizer)["sha256"] if retriever.tokenizer is not None else None
    config = index_config(retriever, z.eval_backend)
    out = Path(candidates_dir)
    reports: dict[str, Any] = {}
    files: dict[str, dict[str, Any]] = {}
    if z.candidate_splits:
        # Files are rewritten one split at a time: until the last is written, the manifest lists none, so a
        # run stopped half way (a rerun into the same directory) leaves no old manifest vouching for a mix
        # of this run's files and the last run's (rerank.candidates.check_listed refuses them all).
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, CANDIDATES_KIND, 1, k=z.k, preset=retriever.config.preset, m=retriever.config.m,
                       setting="own_world", splits={}, complete=False)
    for split in dict.fromkeys([*z.eval_splits, *z.candidate_splits]):
        store_dir = train_store if split in TRAIN_STORE_SPLITS else eval_store
        store = EntityStore(store_dir, tokenizer_sha256=sha)
        mentions = MentionTable(store_dir, split)
        path = out / candidates_file(split) if split in z.candidate_splits else None
        log(f"evaluating {split}: {len(mentions):,} mentions over {store.num_entities:,} entities of "
            f"{len(split_world_ranges(store, mentions))} worlds ({config.backend})")
        reports[split] = evaluate_split(retriever, store, mentions, z.k, config, split in z.eval_splits, path,
                                        z.eval_batch_size, progress)
        reports[split]["store"] = str(Path(store_dir).resolve())
        if path is not None:
            files[split] = {"file": path.name, "store": reports[split]["store"], "mentions": len(mentions),
                            "store_fingerprint": store_fingerprint(store_dir)}  # rerank.candidates.store_problem
    if files:
        write_manifest(out, CANDIDATES_KIND, 1, k=z.k, preset=retriever.config.preset, m=retriever.config.m,
                       setting="own_world", splits=files, complete=True)
    return reports


def recall_table(reports: dict[str, Any], k: int) -> str:
    """Fixed-width table: split x setting, recall@k and top-1 accuracy, macro (over worlds) and micro."""
    head = f"{'split':<20}{'setting':<13}{'mentions':>9}{f'R@{k} macro':>13}{f'R@{k} micro':>13}" \
           f"{'acc macro':>11}{'acc micro':>11}"
    lines = [head]
    for split, rep in reports.items():
        for setting in SETTINGS:
            r = rep.get(setting)
            if r is None:
                continue
            rec, acc = r[f"recall@{k}"], r["accuracy"]
            lines.append(f"{split:<20}{setting:<13}{r['n_mentions']:>9}{rec['macro']:>13.4f}{rec['micro']:>13.4f}"
                         f"{acc['macro']:>11.4f}{acc['micro']:>11.4f}")
    # A world of at most k entities ranks all of them: its own-world R@k is 1 whatever the model does.
    small = sorted({(w, b - a) for rep in reports.values() for w, (a, b) in (rep.get("worlds") or {}).items()
                    if b - a <= k})
    lines += [f"note: world {w} has {n} entities <= k = {k}: its own-world R@{k} is 1 by construction"
              for w, n in small]
    return "\n".join(lines)
