"""The two prepared Zeshel stores a run needs (driver side), prepared once and reused.

``data.prepared_dir`` gets the train worlds' documents and the train/heldout mentions,
``zeshel.eval_store`` the val and test worlds' documents and mentions (see
:mod:`dist_nce.zeshel.config`). A synthetic tree is generated first when configured.
Both steps resume when interrupted and do nothing when already done. A synthetic tree
generated with other settings is generated again, and so are the stores prepared from it
(:mod:`kb.synthetic.cache`); ``kb.prepare`` refuses a store prepared from other real inputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dist_nce.core.config import ConfigError
from dist_nce.zeshel.config import (EVAL_STORE_SPLITS, TRAIN_STORE_SPLITS, ZeshelRetrieverConfig,
                                    held_out_world_problems, synthetic_mentions)


def ensure_synthetic(cfg: ZeshelRetrieverConfig, log: Callable[[str], None] = print) -> str | None:
    """The Zeshel tree to prepare from: ``data.zeshel_root``, or the synthetic tree, generated
    (again) unless it already holds what the config's ``zeshel.synthetic_*`` settings give."""
    z = cfg.zeshel
    if cfg.data.zeshel_root or z.synthetic_entities_per_world <= 0:
        return cfg.data.zeshel_root
    from kb.synthetic.cache import ensure_zeshel

    return str(ensure_zeshel(z.synthetic_dir, z.synthetic_worlds, z.synthetic_entities_per_world,
                             synthetic_mentions(z), z.synthetic_seed, log=log))


def prepare_store(root: str, out: str, worlds: str, splits: tuple[str, ...], cfg: ZeshelRetrieverConfig,
                  log: Callable[[str], None] = print) -> str:
    """Prepare the store of ``worlds`` with those of ``splits`` the tree has (kb.prepare finds
    a store already prepared from the same inputs and leaves it; one from other real inputs
    is an error, one from an older synthetic tree is prepared again)."""
    from dist_nce.train.data import skip_hint
    from kb.prepare import ensure_store

    present = _present(root, splits)
    if not present:
        raise ConfigError(f"{root}: no mentions/{{{','.join(splits)}}}.json: the {worlds} worlds' store needs at "
                          f"least one of these mention splits")
    d = cfg.data
    if not (Path(out) / "manifest.json").exists():
        log(f"preparing {out}: {worlds} worlds, mentions {', '.join(present)} (entity max {d.entity_max_len}, "
            f"mention max {d.mention_max_len} tokens)")
    with skip_hint():
        ensure_store(_prepare_config(root, out, worlds, present, cfg), log, regenerate_from=_regenerated(cfg, root))
    return out


def _present(root: str, splits: tuple[str, ...]) -> list[str]:
    """Those of ``splits`` whose mentions file the tree has."""
    return [s for s in splits if (Path(root) / "mentions" / f"{s}.json").is_file()]


def _prepare_config(root: str, out: str, worlds: str, present: list[str], cfg: ZeshelRetrieverConfig):
    from kb.prepare import PrepareConfig

    d = cfg.data
    return PrepareConfig(out=out, zeshel_root=root, zeshel_worlds=worlds, zeshel_splits=",".join(present),
                         zeshel_strip_title=cfg.zeshel.strip_title, model_dir=cfg.model.retriever.mention_model,
                         mention_max_len=d.mention_max_len, entity_max_len=d.entity_max_len,
                         workers=d.prepare_workers, on_bad_record=d.on_bad_record, progress=False)


def _regenerated(cfg: ZeshelRetrieverConfig, root: str) -> str | None:
    """The synthetic tree a store derived from is prepared again from (None: a real tree's store is refused)."""
    return root if cfg.zeshel.synthetic_entities_per_world > 0 and not cfg.data.zeshel_root else None


def store_conflicts(cfg: ZeshelRetrieverConfig) -> list[str]:
    """For ``--dry-run``: what preparing the two stores would refuse at once (a store there prepared from
    other inputs or settings: ``kb.prepare.conflict``), without generating or preparing anything. A tree
    not generated yet has nothing to compare."""
    from kb.prepare import conflict

    root = cfg.data.zeshel_root or (cfg.zeshel.synthetic_dir if cfg.zeshel.synthetic_entities_per_world > 0 else None)
    if root is None or not Path(root).is_dir():
        return []
    out = []
    for key, store, worlds, splits in (("data.prepared_dir", cfg.data.prepared_dir, "train", TRAIN_STORE_SPLITS),
                                       ("zeshel.eval_store", cfg.zeshel.eval_store, "val,test", EVAL_STORE_SPLITS)):
        present = _present(root, splits)
        problem = conflict(_prepare_config(root, store, worlds, present, cfg), _regenerated(cfg, root)) \
            if present else None
        out += [f"{key}: {problem}: {key}=<another directory> to keep it"] if problem else []
    return out


def ensure_zeshel_stores(cfg: ZeshelRetrieverConfig, log: Callable[[str], None] = print) -> tuple[str, str]:
    """(train store, eval store), prepared (again) where the configured tree asks for it."""
    root = ensure_synthetic(cfg, log)
    missing = [p for p in (cfg.data.prepared_dir, cfg.zeshel.eval_store) if not (Path(p) / "manifest.json").exists()]
    if missing and root is None:
        raise FileNotFoundError(f"not prepared: {', '.join(missing)}; set data.zeshel_root or "
                                "zeshel.synthetic_entities_per_world")
    if root is None:
        from dist_nce.train.data import check_prepared_lengths

        for store in (cfg.data.prepared_dir, cfg.zeshel.eval_store):
            check_prepared_lengths(Path(store), cfg.data)
    else:
        prepare_store(root, cfg.data.prepared_dir, "train", TRAIN_STORE_SPLITS, cfg, log)
        prepare_store(root, cfg.zeshel.eval_store, "val,test", EVAL_STORE_SPLITS, cfg, log)
    problems = held_out_world_problems(cfg.data.prepared_dir)
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg.data.prepared_dir, cfg.zeshel.eval_store
