"""The Zeshel retriever job's configuration: the AIDA trainer's sections plus ``zeshel``.

A Zeshel YAML has every section of :class:`~dist_nce.train.config.TrainJobConfig`
(``data``, ``model``, ``negatives``, ``service``, ``refresh``, ``optim``, ``deepspeed``,
``run``) and one more, ``zeshel``. The trainer receives :func:`training_config`: the
same run without the ``zeshel`` section, so the AIDA and Zeshel retrievers share one
trainer and one NegativeService.

Two prepared stores (``kb.prepare --zeshel-worlds``), so that negatives come from the
union of the TRAINING worlds' entities as in the paper:

* ``data.prepared_dir``: the train worlds' documents and the mentions that link into
  them (``train`` + the heldout splits); the trainer and its shards use this one;
* ``zeshel.eval_store``: the val and test worlds' documents with the val/test mentions.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from typing import Literal, Optional

from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, ConfigError, Range
from dist_nce.train.config import TrainJobConfig, check_inputs, with_absolute_paths
from kb.zeshel import ZESHEL_SPLITS, ZESHEL_WORLDS

TRAIN_STORE_SPLITS = ("train", "heldout_train_seen", "heldout_train_unseen")
EVAL_STORE_SPLITS = ("val", "test")


def _help(text: str, bounds: Range | None = None, **kw):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    return field(metadata={"help": text, **({"range": bounds} if bounds else {})}, **kw)


@dataclass
class ZeshelConfig:
    eval_store: str = _help("Prepared store of the val and test worlds (prepared on first run if missing).",
                            default="data/prepared/zeshel_eval")
    strip_title: bool = _help("Drop the title every Zeshel document text starts with (kb.prepare "
                              "--zeshel-strip-title): the entity input is then [CLS] title [unused2] rest.",
                              default=False)
    synthetic_entities_per_world: int = _help(
        "If > 0 and data.zeshel_root is unset: generate a synthetic Zeshel tree first (kb.synthetic).",
        AT_LEAST_0, default=0)
    synthetic_mentions_per_world: int = _help("Synthetic mentions per world.", AT_LEAST_1, default=200)
    synthetic_eval_mentions_per_world: int = _help(
        "Synthetic mentions per val/test world (0 = synthetic_mentions_per_world): evaluation needs fewer "
        "mentions than training, and exact SOM scoring costs per mention.", AT_LEAST_0, default=0)
    synthetic_worlds: list[str] = _help("Synthetic worlds (real names; each goes to its real split).",
                                        default_factory=lambda: [w for ws in ZESHEL_WORLDS.values() for w in ws])
    synthetic_dir: str = _help("Where the synthetic Zeshel tree is written.", default="data/synthetic/zeshel")
    synthetic_seed: int = _help("Seed of the synthetic generator.", AT_LEAST_0, default=0)
    k: int = _help("Top-k of the evaluation and of the candidates files (64 in the paper).", AT_LEAST_1, default=64)
    eval_splits: list[str] = _help("Splits evaluated (recall@k own world and split union) after training.",
                                   default_factory=lambda: list(EVAL_STORE_SPLITS))
    candidate_splits: list[str] = _help(
        "Splits whose top-k candidates are written for the reranker (own-world search).",
        default_factory=lambda: ["train", *EVAL_STORE_SPLITS])
    candidates_dir: Optional[str] = _help("Where candidates_<split>.json go (default <run.output_dir>/candidates).",
                                          default=None)
    eval_backend: Literal["auto", "torch", "flat"] = _help(
        "In-process index of the evaluation: auto = faiss flat for dual/multi where faiss is installed, "
        "exact torch otherwise (the same ranking).",
        default="auto")
    eval_batch_size: int = _help("Mentions per encoder batch in the evaluation.", AT_LEAST_1, default=128)
    eval_device: str = _help("Device of the evaluation (auto: cuda if available).", default="auto")

    def validate(self) -> None:
        for name in ("eval_splits", "candidate_splits"):
            bad = [s for s in getattr(self, name) if s not in ZESHEL_SPLITS]
            if bad:
                raise ValueError(f"zeshel.{name}: unknown splits {bad}; expected some of {list(ZESHEL_SPLITS)}")
        known = {w for ws in ZESHEL_WORLDS.values() for w in ws}
        bad = [w for w in self.synthetic_worlds if w not in known]
        if bad:
            raise ValueError(f"zeshel.synthetic_worlds: unknown worlds {bad}")


@dataclass
class ZeshelRetrieverConfig(TrainJobConfig):
    zeshel: ZeshelConfig = _help("Zeshel data, evaluation and candidates files.", default_factory=ZeshelConfig)

    def validate(self) -> None:
        super().validate()
        if not self.run.export:
            raise ValueError("run.export must be true: the evaluation and the candidates files read the "
                             "exported model")
        stores = {"train": TRAIN_STORE_SPLITS, "eval": EVAL_STORE_SPLITS}
        if self.data.train_split not in stores["train"] or self.data.dev_split not in stores["train"]:
            raise ValueError(f"data.train_split and data.dev_split must be splits of the train worlds "
                             f"{list(TRAIN_STORE_SPLITS)} (the trainer's store holds only those worlds), got "
                             f"{self.data.train_split!r} and {self.data.dev_split!r}")


ZESHEL_PATH_FIELDS = ("zeshel.eval_store", "zeshel.synthetic_dir", "zeshel.candidates_dir")


def training_config(cfg: ZeshelRetrieverConfig) -> TrainJobConfig:
    """The trainer's config: every section but ``zeshel`` (a TrainJobConfig, as the workers expect)."""
    return TrainJobConfig(**{f.name: copy.deepcopy(getattr(cfg, f.name)) for f in fields(TrainJobConfig)})


def absolute(cfg: ZeshelRetrieverConfig, base: str | None = None) -> ZeshelRetrieverConfig:
    """:func:`dist_nce.train.config.with_absolute_paths` (which covers ``data.zeshel_root``) plus
    the ``zeshel`` paths."""
    out = with_absolute_paths(cfg, base)
    base = base or os.getcwd()
    for dotted in ZESHEL_PATH_FIELDS:
        name = dotted.split(".", 1)[1]
        value = getattr(out.zeshel, name)
        if value and "://" not in value and not os.path.isabs(value):
            setattr(out.zeshel, name, os.path.normpath(os.path.join(base, value)))
    return out


def synthetic_mentions(z: ZeshelConfig) -> dict[str, int]:
    """World -> synthetic mentions to generate (val/test worlds may get fewer)."""
    train = set(ZESHEL_WORLDS["train"])
    n_eval = z.synthetic_eval_mentions_per_world or z.synthetic_mentions_per_world
    return {w: z.synthetic_mentions_per_world if w in train else n_eval for w in z.synthetic_worlds}


def candidates_dir(cfg: ZeshelRetrieverConfig) -> str:
    return cfg.zeshel.candidates_dir or os.path.join(cfg.run.output_dir, "candidates")


def source_root(cfg: ZeshelRetrieverConfig) -> str | None:
    """The Zeshel tree the stores are prepared from: data.zeshel_root, or the synthetic one."""
    if cfg.data.zeshel_root:
        return cfg.data.zeshel_root
    return cfg.zeshel.synthetic_dir if cfg.zeshel.synthetic_entities_per_world > 0 else None


def held_out_world_problems(store: str) -> list[str]:
    """Zeshel's zero-shot protocol: the training store (the trainer's mentions, the shards' negatives) holds
    no entity of a val or test world. A store prepared from a whole tree (``jobs/prepare_kb.py --zeshel-root``
    without ``--zeshel-worlds``) does, and training on it would see the worlds it is evaluated on."""
    import json

    manifest = os.path.join(store, "manifest.json")
    if not os.path.isfile(manifest):
        return []
    with open(manifest, encoding="utf-8") as f:
        worlds = (json.load(f).get("entities") or {}).get("worlds") or {}
    held = [w for w in (*ZESHEL_WORLDS["val"], *ZESHEL_WORLDS["test"]) if w in worlds]
    if not held:
        return []
    return [f"data.prepared_dir: {store} holds the entities of val/test worlds ({', '.join(held)}): training on it "
            "would draw negatives from the worlds it is evaluated on; prepare the train worlds alone "
            "(jobs/prepare_kb.py --zeshel-worlds train, and --zeshel-worlds val,test for zeshel.eval_store), or "
            "set data.zeshel_root and the job prepares both stores"]


def check_zeshel_inputs(cfg: ZeshelRetrieverConfig) -> None:
    """Raise ConfigError naming every missing input, before any data or cluster work.

    The trainer's own check (:func:`dist_nce.train.config.check_inputs`) runs on the
    training config; a train store not prepared yet is fine when a Zeshel source (real or
    synthetic) is configured, since the job prepares it first.
    """
    train = training_config(cfg)
    problems: list[str] = []
    prepared = os.path.isfile(os.path.join(cfg.data.prepared_dir, "manifest.json"))
    root = source_root(cfg)
    if not prepared and root is None:
        problems.append(f"data.prepared_dir: {cfg.data.prepared_dir} is not prepared and no source is given: set "
                        "data.zeshel_root or zeshel.synthetic_entities_per_world > 0")
    if cfg.data.zeshel_root and not os.path.isdir(cfg.data.zeshel_root):
        problems.append(f"data.zeshel_root: directory not found: {cfg.data.zeshel_root}")
    problems += held_out_world_problems(cfg.data.prepared_dir)
    d = cfg.data
    if d.kilt_knowledge_source or d.blink_entities or d.aida_dir or d.synthetic_entities:
        problems.append("data.kilt_knowledge_source / data.blink_entities / data.aida_dir / data.synthetic_entities "
                        "are AIDA inputs; a Zeshel run uses data.zeshel_root or zeshel.synthetic_*")
    if not prepared:
        # Checked against the store once it exists; here only what does not need it.
        train.data.zeshel_root = train.data.zeshel_root or "."
    try:
        check_inputs(train, aida=False)
    except ConfigError as e:
        problems.extend(str(e).split("\n  ")[1:])
    if problems:
        raise ConfigError("invalid inputs:\n  " + "\n  ".join(problems))
    from dist_nce.train.model import check_blink_init

    check_blink_init(train.model, train.optim.seed)  # loads the checkpoint: after the cheap checks passed
