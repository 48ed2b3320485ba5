"""The two prepared Zeshel stores a run needs (driver side), prepared once and reused.

``data.prepared_dir`` gets the train worlds' documents and the train/heldout mentions,
``zeshel.eval_store`` the val and test worlds' documents and mentions (see
:mod:`dist_nce.zeshel.config`). A synthetic tree is generated first when configured.
Both steps resume when interrupted and do nothing when already done (``kb.prepare``
refuses a directory prepared from other inputs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dist_nce.zeshel.config import EVAL_STORE_SPLITS, TRAIN_STORE_SPLITS, ZeshelRetrieverConfig, synthetic_mentions


def ensure_synthetic(cfg: ZeshelRetrieverConfig, log: Callable[[str], None] = print) -> str | None:
    """Generate the synthetic Zeshel tree if it is the configured source and not there yet."""
    z = cfg.zeshel
    if cfg.data.zeshel_root or z.synthetic_entities_per_world <= 0:
        return cfg.data.zeshel_root
    out = Path(z.synthetic_dir)
    if (out / "manifest.json").exists():
        check_synthetic(out, cfg)
    else:
        from kb.synthetic import write_zeshel

        mentions = synthetic_mentions(z)
        log(f"generating synthetic Zeshel: {len(z.synthetic_worlds)} worlds x {z.synthetic_entities_per_world:,} "
            f"documents, mentions per world {sorted(set(mentions.values()))} -> {out}")
        write_zeshel(out, z.synthetic_worlds, z.synthetic_entities_per_world, mentions, z.synthetic_seed)
    return str(out)


def check_synthetic(directory: Path, cfg: ZeshelRetrieverConfig) -> None:
    """Refuse a synthetic tree generated with other settings than the config's (it would be
    used silently otherwise: the stores are prepared from whatever the directory holds)."""
    import json

    z = cfg.zeshel
    m = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    want = {"worlds": list(z.synthetic_worlds), "seed": z.synthetic_seed,
            "entities_per_world": {w: z.synthetic_entities_per_world for w in z.synthetic_worlds},
            "mentions_per_world": synthetic_mentions(z)}
    differs = [k for k, v in want.items() if m.get(k) != v]
    if differs:
        raise ValueError(f"{directory} holds synthetic Zeshel data generated with other settings (differs in: "
                         f"{', '.join(differs)}); delete it (and the stores prepared from it) or set "
                         "zeshel.synthetic_dir, data.prepared_dir and zeshel.eval_store to new directories")


def prepare_store(root: str, out: str, worlds: str, splits: tuple[str, ...], cfg: ZeshelRetrieverConfig,
                  log: Callable[[str], None] = print) -> str:
    """Prepare the store of ``worlds`` with those of ``splits`` the tree has (kb.prepare finds
    a store already prepared from the same inputs and leaves it; one from others is an error)."""
    from kb.prepare import PrepareConfig, prepare, summarize

    fresh = not (Path(out) / "manifest.json").exists()
    present = [s for s in splits if (Path(root) / "mentions" / f"{s}.json").is_file()]
    d = cfg.data
    if fresh:
        log(f"preparing {out}: {worlds} worlds, mentions {', '.join(present)} (entity max {d.entity_max_len}, "
            f"mention max {d.mention_max_len} tokens)")
    prepare(PrepareConfig(out=out, zeshel_root=root, zeshel_worlds=worlds, zeshel_splits=",".join(present),
                          zeshel_strip_title=cfg.zeshel.strip_title, model_dir=cfg.model.retriever.mention_model,
                          mention_max_len=d.mention_max_len, entity_max_len=d.entity_max_len,
                          workers=d.prepare_workers, progress=False), log=log if fresh else lambda _: None)
    if fresh:
        log(summarize(out))
    return out


def ensure_zeshel_stores(cfg: ZeshelRetrieverConfig, log: Callable[[str], None] = print) -> tuple[str, str]:
    """(train store, eval store), preparing whichever is missing."""
    root = ensure_synthetic(cfg, log)
    missing = [p for p in (cfg.data.prepared_dir, cfg.zeshel.eval_store) if not (Path(p) / "manifest.json").exists()]
    if missing and root is None:
        raise FileNotFoundError(f"not prepared: {', '.join(missing)}; set data.zeshel_root or "
                                "zeshel.synthetic_entities_per_world")
    if root is None:
        return cfg.data.prepared_dir, cfg.zeshel.eval_store
    train = prepare_store(root, cfg.data.prepared_dir, "train", TRAIN_STORE_SPLITS, cfg, log)
    evaluation = prepare_store(root, cfg.zeshel.eval_store, "val,test", EVAL_STORE_SPLITS, cfg, log)
    return train, evaluation
