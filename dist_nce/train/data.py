"""Make sure the prepared KB a run trains on exists and matches the config (driver side).

With sources configured (KILT or BLINK entities with AIDA files, a Zeshel tree, or
``data.synthetic_entities > 0``, which generates synthetic KILT + AIDA files first), ``kb.prepare`` runs
every time: it leaves a store prepared from the same inputs as it is, resumes an interrupted
one, and refuses a store prepared from other inputs. Synthetic data and a store prepared
from it are derived data, so when the ``synthetic_*`` settings change both are made again
instead of being reused stale (:mod:`kb.synthetic.cache`). Without sources,
``data.prepared_dir`` is used as it is, after checking that its token lengths are the
config's.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable

from dist_nce.train.config import DataConfig, data_source_problems, prepared_length_problems


def ensure_prepared(d: DataConfig, tokenizer_dir: str | None, log: Callable[[str], None] = print) -> str:
    """Return ``d.prepared_dir``, (re)preparing it first unless it already holds the store
    the configured sources give."""
    from kb.prepare import ensure_store

    problems = data_source_problems(d)  # also checked with the config; here again against the store as it is now
    if problems:
        raise ValueError("\n".join(problems))
    out = Path(d.prepared_dir)
    kilt_ks, blink, aida_dir, zeshel_root = d.kilt_knowledge_source, d.blink_entities, d.aida_dir, d.zeshel_root
    if not (kilt_ks or blink or zeshel_root or d.synthetic_entities > 0):
        if not (out / "manifest.json").exists():
            raise FileNotFoundError(f"{out}: not prepared, and no source or synthetic size is configured")
        return str(out)
    synthetic = None
    if not (kilt_ks or blink or zeshel_root):
        from kb.synthetic import KB_FILE
        from kb.synthetic.cache import ensure_kilt

        synthetic = Path(d.synthetic_dir)
        # Large KBs are rendered by prepare_workers processes (each KB line is a pure function of its
        # position: the files do not depend on it); one process takes ~220 s for 1M entities, and a pool's
        # start-up is not worth it for the small test KBs.
        workers = d.prepare_workers if d.synthetic_entities >= 100_000 else 1
        # The words come from the tokenizer's vocabulary (MiniLM's when no model is named: the same
        # bert-uncased vocabulary as BERT-base's, so the same files), so no other model must be installed.
        vocab = Path(tokenizer_dir) / "vocab.txt" if tokenizer_dir else None
        ensure_kilt(synthetic, d.synthetic_entities, d.synthetic_train, d.synthetic_dev, d.synthetic_test,
                    d.synthetic_seed, workers=workers, vocab_path=vocab if vocab and vocab.exists() else None,
                    log=log)
        kilt_ks, aida_dir = str(synthetic / KB_FILE), str(synthetic)
    if not (out / "manifest.json").exists():
        log(f"preparing {out} (entity max {d.entity_max_len}, mention max {d.mention_max_len} tokens)")
    with skip_hint():
        ensure_store(_prepare_config(d, tokenizer_dir, kilt_ks, aida_dir), log, regenerate_from=synthetic)
    return str(out)


def _prepare_config(d: DataConfig, tokenizer_dir: str | None, kilt_ks: str | None, aida_dir: str | None):
    from kb.prepare import PrepareConfig

    return PrepareConfig(out=str(d.prepared_dir), kilt_ks=kilt_ks, blink_entities=d.blink_entities, aida_dir=aida_dir,
                         zeshel_root=d.zeshel_root, model_dir=tokenizer_dir, mention_max_len=d.mention_max_len,
                         entity_max_len=d.entity_max_len, workers=d.prepare_workers, on_bad_record=d.on_bad_record,
                         progress=False)


def store_conflict(d: DataConfig, tokenizer_dir: str | None) -> str | None:
    """For ``--dry-run``: what preparing ``d.prepared_dir`` from the configured real sources would refuse at
    once (a store there prepared from other inputs or settings: ``kb.prepare.conflict``), without preparing.
    Synthetic data is left out: a store derived from it is prepared again, not refused."""
    from kb.prepare import conflict

    if not (d.kilt_knowledge_source or d.blink_entities or d.zeshel_root) or data_source_problems(d):
        return None
    problem = conflict(_prepare_config(d, tokenizer_dir, d.kilt_knowledge_source, d.aida_dir))
    return f"data.prepared_dir: {problem}: data.prepared_dir=<another directory> to keep it" if problem else None


@contextlib.contextmanager
def skip_hint():
    """A malformed source line stops a job's preparation as it stops jobs/prepare_kb.py's, with the
    config key that skips it instead of the flag."""
    from dist_nce.core.records import BadRecord

    try:
        yield
    except BadRecord as e:
        raise ValueError(f"{e}\n  (set data.on_bad_record=skip to skip malformed lines and list them in the "
                         "store's manifest)") from None


def check_prepared_lengths(store_dir: Path, d: DataConfig) -> None:
    """Raise ValueError where ``store_dir`` was tokenized at other lengths than ``d`` asks for."""
    manifest = json.loads((store_dir / "manifest.json").read_text(encoding="utf-8"))
    problems = prepared_length_problems(manifest, d, str(store_dir))
    if problems:
        raise ValueError("; ".join(problems))
