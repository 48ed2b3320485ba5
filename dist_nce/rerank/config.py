"""The reranker job's typed configuration (``jobs/zeshel_reranker.py``).

Optimisation and DeepSpeed sections are the retriever trainer's own dataclasses
(:class:`~dist_nce.train.config.OptimConfig`, :class:`~dist_nce.train.config.DeepSpeedConfig`),
so the two jobs read alike.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, ConfigError, Range, absolute_paths, plain_name
from dist_nce.modeling.reranker import RerankerConfig
from dist_nce.train.config import DeepSpeedConfig, OptimConfig, WorkerRunConfig
from kb.zeshel import ZESHEL_SPLITS


def _help(text: str, bounds: Range | None = None, check=None, **kw):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    meta = {"help": text, **({"range": bounds} if bounds else {}), **({"check": check} if check else {})}
    return field(metadata=meta, **kw)


@dataclass
class RerankDataConfig:
    train_store: str = _help("Prepared store holding the training split (the retriever's data.prepared_dir).",
                             default="data/prepared/zeshel_train")
    eval_store: str = _help("Prepared store holding the evaluation splits (the retriever's zeshel.eval_store).",
                            default="data/prepared/zeshel_eval")
    candidates_dir: str = _help(
        "Directory of candidates_<split>.json (format retriever) or Zeshel's tfidf_candidates/ (format tfidf).",
        default="runs/zeshel/candidates")
    candidates_format: Literal["retriever", "tfidf"] = _help(
        "retriever: {mention_id, candidates} lines from jobs/zeshel_retriever.py; tfidf: Zeshel's "
        "{mention_id, tfidf_candidates} lines.", default="retriever")
    train_split: str = _help("Split the reranker trains on.", default="train")
    eval_splits: list[str] = _help("Splits evaluated after training (accuracy macro over worlds).",
                                   default_factory=lambda: ["val", "test"])
    num_candidates: int = _help("C: candidates per mention in training and evaluation (64 in the paper).",
                                Range(ge=2, why="the gold and at least one other candidate"), default=64)
    max_train_mentions: int = _help("Use only the first N training mentions (0 = all).", AT_LEAST_0, default=0)
    max_eval_mentions: int = _help("Evaluate only the first N mentions of each split (0 = all).", AT_LEAST_0,
                                   default=0)

    def validate(self) -> None:
        bad = [s for s in [self.train_split, *self.eval_splits] if s not in ZESHEL_SPLITS]
        if bad:
            raise ValueError(f"data: unknown Zeshel splits {bad}; expected some of {list(ZESHEL_SPLITS)}")


@dataclass
class RerankModelConfig:
    reranker: RerankerConfig = _help("Cross-encoder: model directory, pair length L, head.",
                                     default_factory=RerankerConfig)
    init_from: Optional[str] = _help(
        "Start from a reranker directory (Reranker.save_pretrained) or a BLINK cross-encoder checkpoint file "
        "(crossencoder_wiki_large.bin; architecture and tokenizer from reranker.model when set, else from the "
        "weights and the default model). Trained with reranker.max_len, dropout and trim_padding, and with "
        "reranker.layout where set (unset: the checkpoint's own); reranker.head must be the checkpoint's.",
        default=None)


@dataclass
class RerankRunConfig(WorkerRunConfig):
    name: str = _help("Run name; Ray Train resumes a run with the same name and storage_path.",
                      check=plain_name, default="zeshel_reranker")
    output_dir: str = _help("Exported reranker, TensorBoard, metrics.jsonl, summary.json.",
                            default="runs/zeshel_reranker")
    eval_batch_size: int = _help("Mentions per reranker forward in evaluation (x C pairs).", AT_LEAST_1,
                                 default=2)
    backend: Literal["ray", "local"] = _help(
        "ray: Ray Train + DeepSpeed workers, checkpoints, resume. local: the same worker in the job's own "
        "process with plain torch (no Ray, no DeepSpeed, no checkpoints; run.num_workers 1; a GPU if "
        "run.use_gpu is true or null and torch sees one), for a machine without Ray or DeepSpeed.",
        default="ray")


@dataclass
class RerankJobConfig:
    data: RerankDataConfig = _help("Stores and candidate files.", default_factory=RerankDataConfig)
    model: RerankModelConfig = _help("The cross-encoder.", default_factory=RerankModelConfig)
    optim: OptimConfig = _help("Optimisation (paper: lr 2e-5, 3 epochs, batch 4, warm-up 0.2).",
                               default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = _help("DeepSpeed engine.", default_factory=DeepSpeedConfig)
    run: RerankRunConfig = _help("Ray Train run, checkpoints, logging, export.", default_factory=RerankRunConfig)

    def validate(self) -> None:
        # Single-field ranges are checked by the loader (field metadata); this relates fields.
        if self.run.backend == "local" and self.run.num_workers != 1:
            raise ValueError(f"run.backend=local trains in one process: run.num_workers must be 1, got "
                             f"{self.run.num_workers}")
        if self.optim.batch_size % self.run.num_workers:
            raise ValueError(f"optim.batch_size={self.optim.batch_size} must be divisible by run.num_workers="
                             f"{self.run.num_workers}")

    @property
    def per_worker_batch(self) -> int:
        return self.optim.batch_size // self.run.num_workers


PATH_FIELDS = ("data.train_store", "data.eval_store", "data.candidates_dir", "model.reranker.model",
               "model.init_from", "deepspeed.config", "run.storage_path", "run.output_dir",
               "run.tracking.wandb.dir")


def with_absolute_paths(cfg: RerankJobConfig, base: str | None = None) -> RerankJobConfig:
    """A copy whose local paths (PATH_FIELDS) are absolute (Ray Train workers run in another directory)."""
    return absolute_paths(cfg, PATH_FIELDS, base)


def check_inputs(cfg: RerankJobConfig) -> None:
    """Raise ConfigError listing every missing input by its config key (before any cluster work)."""
    from dist_nce.eval.zeshel import CandidateFileError
    from dist_nce.rerank.candidates import (candidates_path, num_candidates_problem, read_split_candidates, store_problem,
                                            written_by)
    from dist_nce.worker.engine import load_deepspeed_config
    from dist_nce.worker.tracking import missing_packages

    problems: list[str] = []
    d = cfg.data
    for key, store, splits in (("data.train_store", d.train_store, [d.train_split]),
                               ("data.eval_store", d.eval_store, d.eval_splits)):
        manifest = os.path.join(store, "manifest.json")
        if not os.path.isfile(manifest):
            problems.append(f"{key}: not a prepared store (no manifest.json): {store}")
            continue
        have = json.loads(open(manifest, encoding="utf-8").read()).get("mentions", {})
        problems += [f"{key}: split {s!r} not in {store} (prepared splits: {sorted(have)})" for s in splits
                     if s not in have]
    for split in dict.fromkeys([d.train_split, *d.eval_splits]):
        path = candidates_path(d.candidates_dir, split, d.candidates_format)
        if not path.is_file():
            problems.append(f"data.candidates_dir: {path} not found ({d.candidates_format} candidates of {split}; "
                            f"{written_by(d.candidates_format)})")
            continue
        # Read here, not only by the loader, so that --dry-run and the driver refuse a C the lists
        # cannot fill before any model loads (a second or so for the paper's 49K training lines).
        try:
            lists, _ = read_split_candidates(d.candidates_dir, split, d.candidates_format)
        except CandidateFileError as e:
            problems.append(f"data.candidates_dir: {e}")
            continue
        problem = num_candidates_problem(lists, path, d.num_candidates)
        if problem:
            problems.append(problem)
        if d.candidates_format == "retriever":
            key, store = ("data.train_store", d.train_store) if split == d.train_split else \
                ("data.eval_store", d.eval_store)
            problem = store_problem(d.candidates_dir, split, store, key)
            if problem:
                problems.append(problem)
    if cfg.model.reranker.model and not os.path.isdir(cfg.model.reranker.model):
        problems.append(f"model.reranker.model: directory not found: {cfg.model.reranker.model}")
    init = cfg.model.init_from
    if init and not (os.path.isfile(init) or os.path.isfile(os.path.join(init, "manifest.json"))):
        problems.append(f"model.init_from: neither a reranker directory (with manifest.json) nor a BLINK "
                        f"cross-encoder file: {init}")
    elif init:  # what the workers would refuse once Ray is up (a head the weights do not hold, ...)
        from dist_nce.rerank.start import check_start

        try:
            check_start(init, cfg.model.reranker)
        except (ConfigError, ValueError) as e:  # ArtifactMismatch, BlinkCheckpointError: a record that is not one
            problems.append(str(e) if str(e).startswith("model.") else f"model.init_from: {e}")
    if not os.path.isfile(cfg.deepspeed.config):
        problems.append(f"deepspeed.config: file not found: {cfg.deepspeed.config}")
    else:
        try:
            load_deepspeed_config(cfg.deepspeed.config, cfg.per_worker_batch, cfg.run.num_workers,
                                  cfg.optim.grad_clip, cfg.deepspeed.zero_stage, cfg.deepspeed.bf16)
        except ConfigError as e:
            problems.append(f"deepspeed.config: {e}")
    problems += missing_packages(cfg.run.tracking)
    if problems:
        raise ConfigError("invalid inputs:\n  " + "\n  ".join(problems))
