"""The training job's typed configuration (one YAML file per experiment).

``load_config(TrainJobConfig, "configs/aida/tiny_cpu.yaml", overrides=["optim.lr=2e-5"])``
builds it; unknown keys are an error naming the file and the dotted key. Every field
has a help string: ``python -c "from dist_nce.core.config import describe; from
dist_nce.train.config import TrainJobConfig; print(describe(TrainJobConfig))"``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from dist_nce.actors.config import ServiceConfig
from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, POSITIVE, ConfigError, Range, absolute_paths, plain_name
from dist_nce.modeling.retriever import RetrieverConfig
from dist_nce.modeling.scoring import is_inner_product
from dist_nce.worker.tracking_config import TrackingConfig


def _help(text: str, bounds: Range | None = None, check=None, **kw):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    meta = {"help": text, **({"range": bounds} if bounds else {}), **({"check": check} if check else {})}
    return field(metadata=meta, **kw)


# The fixed tokens of each layout (dist_nce.core.text) plus one token of content.
_MENTION_LEN = Range(ge=5, why="[CLS], [SEP] and the two mention markers take 4")
_ENTITY_LEN = Range(ge=4, why="[CLS], [SEP] and the title marker take 3")


@dataclass
class DataConfig:
    prepared_dir: str = _help("Prepared KB directory (kb.prepare output); prepared on first run if missing.",
                              default="data/prepared/aida")
    kilt_knowledge_source: Optional[str] = _help(
        "kilt_knowledgesource.json to prepare from when prepared_dir does not exist.", default=None)
    blink_entities: Optional[str] = _help(
        "BLINK's entity.jsonl (the entities of BLINK's download, as jobs/prepare_kb.py --blink-entities reads "
        "it) to prepare from instead of kilt_knowledge_source.", default=None)
    aida_dir: Optional[str] = _help(
        "Directory with aidayago2-{train,dev,test_without_answers}-kilt.jsonl: the mentions, read with "
        "kilt_knowledge_source or blink_entities (the KB their golds resolve into).", default=None)
    zeshel_root: Optional[str] = _help("Zeshel root (documents/, mentions/) to prepare from.", default=None)
    synthetic_entities: int = _help(
        "If > 0 and no source is given, generate a synthetic KILT KB + AIDA files of this size first (set 0 to "
        "train on a store prepared from your own files).",
        AT_LEAST_0, default=0)
    synthetic_train: int = _help("Synthetic AIDA train mentions.", AT_LEAST_1, default=1000)
    synthetic_dev: int = _help("Synthetic AIDA dev mentions.", AT_LEAST_1, default=200)
    synthetic_test: int = _help("Synthetic AIDA test mentions.", AT_LEAST_1, default=200)
    synthetic_dir: str = _help("Where synthetic source files are written.", default="data/synthetic/aida")
    synthetic_seed: int = _help("Seed of the synthetic generator (same seed, byte-identical files).", AT_LEAST_0,
                                 default=0)
    train_split: str = _help("Mention split to train on.", default="train")
    dev_split: str = _help("Mention split for periodic evaluation.", default="dev")
    mention_max_len: int = _help("Mention tokens (32 in BLINK, 128 in the paper).", _MENTION_LEN, default=32)
    entity_max_len: int = _help("Entity tokens ([CLS] title [unused2] description [SEP]).", _ENTITY_LEN,
                                 default=128)
    max_train_mentions: int = _help("Use only the first N training mentions (0 = all).", AT_LEAST_0, default=0)
    max_dev_mentions: int = _help("Use only the first N dev mentions (0 = all).", AT_LEAST_0, default=0)
    prepare_workers: int = _help("Processes for preparing the KB (and generating a synthetic one of >= 100k "
                                  "entities).", AT_LEAST_1, default=2)
    on_bad_record: Literal["error", "skip"] = _help(
        "Preparing from the sources: error stops at the first malformed line (file:line: reason); skip counts "
        "and lists them in the store's manifest (jobs/prepare_kb.py --on-bad-record).", default="error")


@dataclass
class ModelConfig:
    retriever: RetrieverConfig = _help("Encoders and score function (preset dual/multi/poly/som/genpoly, m).",
                                       default_factory=RetrieverConfig)
    blink_checkpoint: Optional[str] = _help(
        "BLINK biencoder_wiki_large.bin to initialise from (retriever.mention_model must then be a "
        "bert-large-uncased directory for the tokenizer and config).", default=None)
    init_from: Optional[str] = _help("A dist-nce retriever directory (save_pretrained) to start from.",
                                     default=None)
    freeze_entity_encoder: bool = _help(
        "ELQ-style: keep the entity encoder frozen; the KB is encoded once and never refreshed.", default=False)
    entity_cache: bool = _help(
        "With freeze_entity_encoder: each worker encodes its KB once (eval mode, no dropout) and scores a "
        "step's candidates from those reps instead of re-encoding B x K candidates every step. Memory: the "
        "KB's reps in fp32 per worker (N x d for dual, N x m x d multi, N x entity_max_len x d SOM).",
        default=False)


@dataclass
class NegativesConfig:
    mode: Literal["random", "hard", "mixed"] = _help("Negative distribution (paper section 3).", default="hard")
    p: float = _help("mixed-p: percent of the K-1 negatives that are hard (negatives.num_hard: round half "
                     "up, so p=50, K=64 gives 32 hard + 31 random).", Range(ge=0, le=100, why="a percentage"),
                     default=50.0)
    num_candidates: int = _help("K: gold + K-1 negatives per mention (64 in the paper).",
                                 Range(ge=2, why="the gold and at least one negative"), default=64)
    schedule: Literal["pipelined", "per_epoch"] = _help(
        "pipelined: mine each batch P batches ahead with the current mention encoder; per_epoch: the paper's "
        "mode, mine all training mentions at each epoch start.", default="pipelined")
    prefetch: int = _help("P: mining requests kept in flight ahead of the current batch.", AT_LEAST_0, default=2)
    request_size: int = _help("Mentions per mining request in per_epoch mode (batched requests).", AT_LEAST_1,
                               default=256)
    adjusted_loss: bool = _help("Use the score-adjusted loss (eq. 6) instead of plain hard NCE (eq. 7).",
                                default=False)
    temperature: float = _help("Softmax temperature of the NCE loss (1 in the paper).",
                                Range(gt=0, why="scores are divided by it"), default=1.0)


@dataclass
class RefreshConfig:
    mode: Literal["async", "sync", "never"] = _help(
        "async: train on the old index while shards re-encode (ANCE-style); sync: wait (paper-exact with "
        "every_steps=0 and at_epoch_start); never: encode once (frozen entity encoder).", default="async")
    every_steps: int = _help("Publish entity-encoder weights every N optimizer steps (0 = off).", AT_LEAST_0,
                              default=0)
    at_epoch_start: bool = _help("Refresh at the start of every epoch after the first.", default=True)


@dataclass
class BiasConfig:
    every_steps: int = _help(
        "Measure Theorem 1's gradient bias every N steps on a fixed probe set of training mentions (0 = off): "
        "one extra scoring pass over the KB plus probe_mentions x draws mining queries (dist_nce.bias."
        "monitor); logged as bias/* to TensorBoard and metrics.jsonl.", AT_LEAST_0, default=0)
    probe_mentions: int = _help("Training mentions in the probe set (the first eligible ones).", AT_LEAST_1,
                                default=16)
    draws: int = _help("Candidate sets drawn per probe mention for the Monte Carlo term (its SE shrinks as "
                       "1/sqrt(draws)).", Range(ge=2, why="a standard error needs two draws"), default=16)


@dataclass
class OptimConfig:
    lr: float = _help("Peak learning rate (paper: chosen from {5e-5, 2e-5, 1e-5}).", POSITIVE, default=2e-5)
    epochs: int = _help("Training epochs (paper: up to 4).", AT_LEAST_1, default=1)
    max_steps: int = _help("Stop after this many optimizer steps (0 = run all epochs).", AT_LEAST_0, default=0)
    batch_size: int = _help("Mentions per optimizer step over all workers (paper: 4).", AT_LEAST_1, default=4)
    weight_decay: float = _help("AdamW weight decay.", AT_LEAST_0, default=0.0)
    warmup_proportion: float = _help("Linear warm-up fraction of total steps (BLINK: 0.1).",
                                      Range(ge=0, le=1, why="above 1 the rate never reaches its peak"),
                                      default=0.1)
    grad_clip: float = _help("Gradient norm clipping (BLINK: 1.0; 0 = none).", AT_LEAST_0, default=1.0)
    seed: int = _help("Seed for data order, negatives and initialisation.", AT_LEAST_0, default=0)


@dataclass
class DeepSpeedConfig:
    config: str = _help("DeepSpeed JSON (configs/deepspeed/).", default="configs/deepspeed/zero0_fp32.json")
    zero_stage: Optional[int] = _help("Override zero_optimization.stage of the JSON.",
                                      Range(ge=0, le=3, why="ZeRO has stages 0 to 3"), default=None)
    bf16: Optional[bool] = _help("Override bf16.enabled of the JSON.", default=None)


@dataclass
class WorkerRunConfig:
    """The ``run`` fields every training job has (retriever and reranker): the Ray Train run,
    its workers' resources, fault tolerance, checkpoints and logging (``dist_nce.worker``)."""
    name: str = _help("Run name; Ray Train resumes a run with the same name and storage_path.",
                      check=plain_name, default="aida_tiny")
    storage_path: str = _help("Ray Train storage (shared storage or s3:// on multi-node).",
                              default="runs/ray_results")
    output_dir: str = _help("Exports: Hugging Face model, BLINK layout, KB snapshot, eval JSON.",
                            default="runs/aida_tiny")
    num_workers: int = _help("Ray Train (DeepSpeed) workers.", AT_LEAST_1, default=1)
    use_gpu: Optional[bool] = _help("Train on GPUs (default: auto-detect).", default=None)
    cpus_per_worker: float = _help("CPUs per training worker.", AT_LEAST_0, default=1.0)
    gpus_per_worker: float = _help("GPUs per training worker (fractional shares GPUs with shards).",
                                   AT_LEAST_0, default=1.0)
    resources_per_worker: dict[str, float] = _help(
        "Custom Ray resources each training worker requires, e.g. {trainer: 1} to keep the workers on nodes "
        "started with --resources='{\"trainer\": N}' (multi-node placement).", AT_LEAST_0, default_factory=dict)
    max_failures: int = _help("Ray Train FailureConfig.max_failures (worker restarts from checkpoint).",
                              AT_LEAST_0, default=2)
    checkpoint_every_steps: int = _help("Checkpoint every N steps (0 = only at epoch ends).", AT_LEAST_0,
                                         default=0)
    stop_after_steps: int = _help(
        "End this job after N steps of the run (with a checkpoint) without finishing it; running the same "
        "run.name again continues (time-boxed or preemptible clusters). 0 = run to the end.", AT_LEAST_0,
        default=0)
    num_to_keep: int = _help("Checkpoints kept by Ray Train.", Range(ge=1, why="resuming needs one"), default=2)
    log_every_steps: int = _help("TensorBoard/report scalars every N steps.", AT_LEAST_1, default=1)
    progress: bool = _help("tqdm progress bar on rank 0.", default=True)
    tracking: TrackingConfig = _help(
        "MLflow / Weights & Biases through Ray's integrations, besides TensorBoard and metrics.jsonl (off by "
        "default; docs/tracking.md).", default_factory=TrackingConfig)


@dataclass
class RunConfig(WorkerRunConfig):
    eval_every_steps: int = _help("Dev recall/accuracy every N steps (0 = only at the end).", AT_LEAST_0, default=0)
    eval_k: list[int] = _help("Recall@k cut-offs for dev evaluation.", AT_LEAST_1,
                              default_factory=lambda: [1, 10, 64])
    eval_batch_size: int = _help("Dev mentions per encoder forward / top-k request.", AT_LEAST_1, default=64)
    export: bool = _help("Export model (HF + BLINK layout) and KB snapshot at the end.", default=True)
    evaluate_before: bool = _help("Evaluate the untrained model on dev first (before vs after).", default=True)


@dataclass
class TrainJobConfig:
    data: DataConfig = _help("Knowledge base and mention data.", default_factory=DataConfig)
    model: ModelConfig = _help("Retriever architecture and initialisation.", default_factory=ModelConfig)
    negatives: NegativesConfig = _help("Negative sampling.", default_factory=NegativesConfig)
    service: ServiceConfig = _help("The sharded negative service.", default_factory=ServiceConfig)
    refresh: RefreshConfig = _help("When the KB is re-encoded.", default_factory=RefreshConfig)
    bias: BiasConfig = _help("The live gradient-bias monitor (Theorem 1).", default_factory=BiasConfig)
    optim: OptimConfig = _help("Optimisation.", default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = _help("DeepSpeed engine.", default_factory=DeepSpeedConfig)
    run: RunConfig = _help("Ray Train run, checkpoints, logging, exports.", default_factory=RunConfig)

    def validate(self) -> None:
        # Single-field ranges are checked by the loader (field metadata); these relate fields.
        if not self.run.eval_k:
            raise ValueError("run.eval_k: []: needs at least one recall@k cut-off")
        if self.optim.batch_size % self.run.num_workers:
            raise ValueError(
                f"optim.batch_size={self.optim.batch_size} must be divisible by run.num_workers="
                f"{self.run.num_workers}")
        if self.model.freeze_entity_encoder and self.refresh.mode != "never":
            raise ValueError("model.freeze_entity_encoder needs refresh.mode: never (the KB is encoded once)")
        if self.model.entity_cache and not self.model.freeze_entity_encoder:
            raise ValueError("model.entity_cache needs model.freeze_entity_encoder: true (a trained entity "
                             "tower changes the reps every step)")
        # the service refuses this too, but only once Ray and the shards are up (a traceback, exit 1)
        retriever = self.model.retriever
        if self.service.index.backend != "torch" and not is_inner_product(retriever.spec()):
            raise ValueError(f"service.index.backend: {self.service.index.backend!r} serves inner-product scores "
                             f"only; model.retriever.preset {retriever.preset!r} needs service.index.backend: torch")

    @property
    def per_worker_batch(self) -> int:
        return self.optim.batch_size // self.run.num_workers


def check_inputs(cfg: TrainJobConfig, aida: bool = True) -> None:
    """Raise ConfigError listing every missing input (files, directories, DeepSpeed JSON)
    named by its config key, so a typo fails in a second, before any cluster work.

    aida: the data section is the AIDA job's (its sources against ``data.prepared_dir``:
    :func:`data_source_problems`); a Zeshel run passes False (``dist_nce.zeshel.data`` prepares its stores).
    """
    from dist_nce.worker.engine import load_deepspeed_config
    from dist_nce.worker.tracking import missing_packages

    problems: list[str] = []

    def need(key: str, path: str | None, kind: str) -> bool:
        if path is None:
            return True
        ok = os.path.isdir(path) if kind == "directory" else os.path.isfile(path)
        if not ok:
            problems.append(f"{key}: {kind} not found: {path}{_beside_repository(path)}")
        return ok

    r = cfg.model.retriever
    need("model.retriever.mention_model", r.mention_model, "directory")
    need("model.retriever.entity_model", r.entity_model, "directory")
    need("model.blink_checkpoint", cfg.model.blink_checkpoint, "file")
    if cfg.model.init_from and need("model.init_from", cfg.model.init_from, "directory"):
        need("model.init_from", os.path.join(cfg.model.init_from, "manifest.json"), "file")
    if cfg.model.blink_checkpoint and cfg.model.init_from:
        problems.append("model.blink_checkpoint and model.init_from: give one initialisation, not both")
    if need("deepspeed.config", cfg.deepspeed.config, "file"):
        try:
            load_deepspeed_config(cfg.deepspeed.config, cfg.per_worker_batch, cfg.run.num_workers,
                                  cfg.optim.grad_clip, cfg.deepspeed.zero_stage, cfg.deepspeed.bf16)
        except ConfigError as e:
            problems.append(f"deepspeed.config: {e}")
    d = cfg.data
    manifest = os.path.join(d.prepared_dir, "manifest.json")
    if os.path.isfile(manifest):
        splits = json.loads(open(manifest, encoding="utf-8").read()).get("mentions", {})
        for key in ("train_split", "dev_split"):
            if getattr(d, key) not in splits:
                problems.append(f"data.{key}: split {getattr(d, key)!r} not in {manifest} "
                                f"(prepared splits: {sorted(splits)})")
    elif d.kilt_knowledge_source or d.blink_entities or d.zeshel_root:
        need("data.kilt_knowledge_source", d.kilt_knowledge_source, "file")
        need("data.blink_entities", d.blink_entities, "file")
        need("data.aida_dir", d.aida_dir, "directory")
        need("data.zeshel_root", d.zeshel_root, "directory")
    elif d.synthetic_entities <= 0:
        problems.append(f"data.prepared_dir: {d.prepared_dir} is not a prepared KB (no manifest.json) and no "
                        "source is given: set data.kilt_knowledge_source (or data.blink_entities) + data.aida_dir, "
                        "data.zeshel_root, or data.synthetic_entities > 0")
    if aida:
        problems += data_source_problems(d)
    problems += missing_packages(cfg.run.tracking)
    if problems:
        raise ConfigError("invalid inputs:\n  " + "\n  ".join(problems))


def _beside_repository(path: str) -> str:
    """A hint when ``path`` (made absolute against the working directory) names a file of the repository:
    the shipped configs' relative paths (``configs/deepspeed/...``) assume the jobs run from its root."""
    repo = str(Path(__file__).resolve().parents[2])
    cwd = os.getcwd()
    if cwd == repo or not path.startswith(cwd + os.sep):
        return ""
    there = os.path.join(repo, os.path.relpath(path, cwd))
    return f" (relative paths resolve against the working directory; {there} exists: run from {repo} or give " \
           "an absolute path)" if os.path.exists(there) else ""


KB_SOURCES = ("kilt_knowledge_source", "blink_entities", "zeshel_root")


def data_source_problems(d: DataConfig) -> list[str]:
    """What the AIDA job would do with ``d`` other than what it says: sources that would be ignored,
    a store of the user's own that the synthetic data would meet, a store cut at other lengths.
    Reads only ``data.prepared_dir``'s manifest."""
    problems = []
    given = [f"data.{k}" for k in KB_SOURCES if getattr(d, k)]
    if len(given) > 1:
        problems.append(f"{' and '.join(given)}: give one KB source, not several")
    if d.aida_dir and not (d.kilt_knowledge_source or d.blink_entities):
        problems.append(f"data.aida_dir: {d.aida_dir} is read only with data.kilt_knowledge_source or "
                        "data.blink_entities (the KB its golds resolve into); to train on a store that "
                        "jobs/prepare_kb.py made, set data.prepared_dir to it and data.synthetic_entities=0")
    manifest = os.path.join(d.prepared_dir, "manifest.json")
    if given or not os.path.isfile(manifest):
        return problems
    fields = json.loads(open(manifest, encoding="utf-8").read())
    if d.synthetic_entities > 0:
        if not _from_synthetic(fields, d):
            source = fields.get("source") or {}
            problems.append(
                f"data.prepared_dir: {d.prepared_dir} holds a store prepared from "
                f"{', '.join(source.get('entity_files') or ['other inputs'])} ({source.get('format')}), not from "
                f"this config's synthetic data (data.synthetic_entities: {d.synthetic_entities}, data.synthetic_dir: "
                f"{d.synthetic_dir}): set data.synthetic_entities=0 to train on it, or give the synthetic data "
                "another data.prepared_dir")
    else:
        problems += prepared_length_problems(fields, d, d.prepared_dir)
    return problems


def _from_synthetic(fields: dict, d: DataConfig) -> bool:
    """Whether the store of manifest ``fields`` was prepared from ``d.synthetic_dir``'s KB: by the paths it
    recorded, or, for a store and synthetic directory moved together, by the KB file's fingerprint."""
    from kb.ingest import file_fingerprint
    from kb.prepare import derived_from
    from kb.synthetic.kilt import KB_FILE

    if derived_from(d.prepared_dir, d.synthetic_dir):
        return True
    kb = os.path.join(d.synthetic_dir, KB_FILE)
    if not os.path.isfile(kb):
        return False
    fp = file_fingerprint(kb)
    return any(f.get("size") == fp["size"] and f.get("sample_sha256") == fp["sample_sha256"]
               for f in (fields.get("source") or {}).get("files") or [])


def prepared_length_problems(fields: dict, d: DataConfig, store: str) -> list[str]:
    """A store is tokenized once: the token lengths ``d`` asks for that the manifest (``fields``) of
    ``store`` differs from (it would silently train on shorter or longer inputs)."""
    return [f"data.{k} is {getattr(d, k)} but the store {store} was prepared with {fields.get(k)} (set it to "
            "the store's, or prepare the store again at these lengths)"
            for k in ("entity_max_len", "mention_max_len") if fields.get(k) != getattr(d, k)]


def check_against_store(cfg: TrainJobConfig, store_dir: str) -> None:
    """Refuse settings the prepared KB is too small for. Call once the store exists and
    before Ray starts: otherwise this surfaces only after version 0 was encoded."""
    manifest = os.path.join(store_dir, "manifest.json")
    fields = json.loads(open(manifest, encoding="utf-8").read())
    n = int(fields["entities"]["count"])  # the rows shards split (version 0 of the store's lineage)
    live = int(fields["versions"][-1]["live"]) if fields.get("versions") else n  # after KB deltas (kb.delta)
    problems = []
    k = cfg.negatives.num_candidates
    if k > live:
        problems.append(f"negatives.num_candidates: {k}: must be <= the {live:,} entities of {store_dir} (the gold "
                        "and K-1 distinct other entities)")
    if cfg.service.num_shards > n:
        problems.append(f"service.num_shards: {cfg.service.num_shards}: must be <= the {n:,} entities of "
                        f"{store_dir} (every shard owns at least one row)")
    if problems:
        raise ConfigError("\n".join(problems))


# Fields holding local paths; resolved on the driver because Ray Train workers run in
# another working directory.
PATH_FIELDS = ("data.prepared_dir", "data.kilt_knowledge_source", "data.blink_entities", "data.aida_dir",
               "data.zeshel_root", "data.synthetic_dir", "model.retriever.mention_model",
               "model.retriever.entity_model", "model.blink_checkpoint", "model.init_from", "deepspeed.config",
               "service.shard_dir", "run.storage_path", "run.output_dir", "run.tracking.wandb.dir")


def with_absolute_paths(cfg: TrainJobConfig, base: str | None = None) -> TrainJobConfig:
    """A copy of ``cfg`` whose local paths (PATH_FIELDS) are absolute (relative to ``base``, default the cwd).
    URIs (``s3://...``) and unset paths are left alone."""
    return absolute_paths(cfg, PATH_FIELDS, base)
