"""The reranker's data: training examples from a candidates file, the plan, evaluation sets.

Built the same way on the driver (to print the plan and fail early) and on every worker,
from the prepared stores and the candidate files; nothing is shipped between them.

Training examples are the mentions whose gold is in the KB (the others are counted and
excluded), each with its first C candidates made gold-first by
:func:`dist_nce.rerank.candidates.gold_first`. The data order reuses the retriever
trainer's pure functions (``dist_nce.train.plan``): epoch ``e`` visits the examples in a
permutation seeded by ``(seed, e)``, so resuming at step ``t`` needs nothing but ``t``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dist_nce.core.config import ConfigError
from dist_nce.eval.zeshel import CandidateSet, candidate_rows
from dist_nce.rerank.candidates import gold_first, num_candidates_problem, read_split_candidates
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.train.plan import DataOrder, settings_of
from kb.store import EntityStore, MentionTable


# What a resumed reranker run must share with its checkpoint besides the plan (as train.plan.RESUME_SETTINGS
# for the retriever, and for its reasons not the model paths): the score head, the pair layout, the objective.
# And the score head's dropout: a rerun that changed it resumed and trained its remaining steps under another
# regularisation than the first ones, recorded in the export as if the whole run had.
RESUME_SETTINGS = ("model.reranker.max_len", "model.reranker.head", "model.reranker.layout",
                   "model.reranker.context_len", "model.reranker.cand_len", "model.reranker.dropout", "optim.lr",
                   "optim.weight_decay", "optim.warmup_proportion", "optim.grad_clip")


@dataclass(frozen=True)
class RerankPlan:
    """Derived quantities of a reranker run (duck-types the fields DataOrder reads)."""

    num_workers: int
    per_worker_batch: int
    global_batch: int
    num_candidates: int
    split_mentions: int
    train_mentions: int
    excluded_missing_gold: int
    gold_inserted: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    seed: int
    # sha256 over the store's manifest and the candidates file: resuming on other data is refused.
    data_fingerprint: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # RESUME_SETTINGS' values (worker.checkpoint)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


@dataclass
class TrainingSet:
    """mention_idx [n] int64 indices into ``mentions``; cands [n, C] rows, gold in column 0;
    inserted [n] bool: the gold was added (the retriever missed it)."""

    mentions: MentionTable
    store: EntityStore
    mention_idx: np.ndarray
    cands: np.ndarray
    inserted: np.ndarray
    candidates: CandidateSet
    source: str


def read_checked_candidates(cfg: RerankJobConfig, split: str) -> tuple[dict[str, list[str]], Path]:
    """The candidate lists of ``split`` and their file; ConfigError when ``data.num_candidates``
    exceeds the longest list (check_inputs says so earlier; this holds for callers that skip it)."""
    d = cfg.data
    raw, path = read_split_candidates(d.candidates_dir, split, d.candidates_format)
    problem = num_candidates_problem(raw, path, d.num_candidates)
    if problem:
        raise ConfigError(problem)
    return raw, path


def load_training_set(cfg: RerankJobConfig, tokenizer_sha256: str | None = None) -> TrainingSet:
    from kb.store import EntityStore, MentionTable

    d = cfg.data
    store = EntityStore(d.train_store, tokenizer_sha256=tokenizer_sha256)
    mentions = MentionTable(d.train_store, d.train_split)
    raw, path = read_checked_candidates(cfg, d.train_split)
    cset = candidate_rows(raw, mentions, store, d.num_candidates, str(path))
    gold = np.asarray(mentions.gold_rows, dtype=np.int64)
    n = min(len(gold), d.max_train_mentions) if d.max_train_mentions else len(gold)
    idx = np.flatnonzero(gold[:n] >= 0).astype(np.int64)
    cands, inserted = gold_first(cset.rows[idx], gold[idx])
    return TrainingSet(mentions, store, idx, cands, inserted, cset, str(path))


def make_plan(cfg: RerankJobConfig, ts: TrainingSet) -> RerankPlan:
    n = len(ts.mention_idx)
    steps_per_epoch = n // cfg.optim.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{n} training mentions with a gold in the KB cannot fill one global batch of "
                         f"{cfg.optim.batch_size}")
    total = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    considered = min(len(ts.mentions), cfg.data.max_train_mentions) if cfg.data.max_train_mentions else \
        len(ts.mentions)
    return RerankPlan(
        num_workers=cfg.run.num_workers, per_worker_batch=cfg.per_worker_batch, global_batch=cfg.optim.batch_size,
        num_candidates=cfg.data.num_candidates, split_mentions=len(ts.mentions), train_mentions=n,
        excluded_missing_gold=considered - n, gold_inserted=int(ts.inserted.sum()),
        steps_per_epoch=steps_per_epoch, epochs=math.ceil(total / steps_per_epoch), total_steps=total,
        seed=cfg.optim.seed, data_fingerprint=_data_fingerprint(cfg.data.train_store, ts.source),
        settings=settings_of(cfg, RESUME_SETTINGS))


def _data_fingerprint(store_dir: str, candidates_file: str) -> str:
    import hashlib
    import os

    from dist_nce.core.artifacts import MANIFEST, file_sha256

    parts = [file_sha256(os.path.join(store_dir, MANIFEST)), file_sha256(candidates_file)]
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()


def data_order(plan: RerankPlan) -> DataOrder:
    """Step -> positions in the TrainingSet (``DataOrder`` over 0..n-1)."""
    return DataOrder(plan, np.arange(plan.train_mentions, dtype=np.int64))  # type: ignore[arg-type]


@dataclass
class EvalSet:
    split: str
    mentions: MentionTable
    store: EntityStore
    candidates: CandidateSet
    source: str

    @property
    def worlds(self) -> list:
        return list(self.mentions.worlds)


def load_eval_sets(cfg: RerankJobConfig, tokenizer_sha256: str | None = None) -> list[EvalSet]:
    """One EvalSet per ``data.eval_splits`` (the first ``max_eval_mentions`` of each when set)."""
    from kb.store import EntityStore, MentionTable

    d = cfg.data
    store = EntityStore(d.eval_store, tokenizer_sha256=tokenizer_sha256)
    out = []
    for split in d.eval_splits:
        mentions = MentionTable(d.eval_store, split)
        if d.max_eval_mentions:
            mentions = MentionRows(mentions, np.arange(min(len(mentions), d.max_eval_mentions)))
        raw, path = read_checked_candidates(cfg, split)
        # Candidates of mentions left out by max_eval_mentions are extra lines: counted, ignored.
        out.append(EvalSet(split, mentions, store, candidate_rows(raw, mentions, store, d.num_candidates, str(path)),
                           str(path)))
    return out


class MentionRows:
    """Mentions ``rows`` of a MentionTable, re-indexed 0..len-1 (what eval.zeshel reads of a table)."""

    def __init__(self, table: Any, rows: np.ndarray):
        self.table, self.rows = table, np.asarray(rows, dtype=np.int64)
        self.split, self.path = table.split, table.path

    def __len__(self) -> int:
        return len(self.rows)

    def token_ids(self, idx: Any) -> np.ndarray:
        return self.table.token_ids(self.rows[np.asarray(idx, dtype=np.int64)])

    @property
    def lengths(self) -> np.ndarray:
        return self.table.lengths[self.rows]

    @property
    def gold_rows(self) -> np.ndarray:
        return self.table.gold_rows[self.rows]

    @property
    def mention_ids(self) -> list[str]:
        ids = self.table.mention_ids
        return [ids[i] for i in self.rows]

    @property
    def worlds(self) -> list:
        w = self.table.worlds
        return [w[i] for i in self.rows]
