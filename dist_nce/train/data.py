"""Make sure the prepared KB a run trains on exists (driver side).

``data.prepared_dir`` with a manifest is used as it is. Otherwise it is prepared from the
configured sources (``kb.prepare``), after generating synthetic KILT + AIDA files first
when ``data.synthetic_entities > 0`` and no source is given (``kb.synthetic``).
Both steps resume when interrupted and do nothing when already done.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from dist_nce.train.config import DataConfig


def ensure_prepared(d: DataConfig, tokenizer_dir: str | None, log: Callable[[str], None] = print) -> str:
    """Return ``d.prepared_dir``, preparing it first if it has no manifest."""
    from kb.prepare import PrepareConfig, prepare, summarize

    out = Path(d.prepared_dir)
    if (out / "manifest.json").exists():
        return str(out)
    kilt_ks, aida_dir, zeshel_root = d.kilt_knowledge_source, d.aida_dir, d.zeshel_root
    if not (kilt_ks or zeshel_root):
        if d.synthetic_entities <= 0:
            raise FileNotFoundError(f"{out}: not prepared, and no source or synthetic size is configured")
        from kb.synthetic import KB_FILE, write_kilt

        syn = Path(d.synthetic_dir)
        if not (syn / "manifest.json").exists():
            log(f"generating a synthetic KILT KB of {d.synthetic_entities:,} entities and AIDA "
                f"{d.synthetic_train}/{d.synthetic_dev}/{d.synthetic_test} mentions in {syn}")
            write_kilt(syn, d.synthetic_entities, d.synthetic_train, d.synthetic_dev, d.synthetic_test,
                       d.synthetic_seed)
        kilt_ks, aida_dir = str(syn / KB_FILE), str(syn)
    log(f"preparing {out} (entity max {d.entity_max_len}, mention max {d.mention_max_len} tokens)")
    prepare(PrepareConfig(out=str(out), kilt_ks=kilt_ks, aida_dir=aida_dir, zeshel_root=zeshel_root,
                          model_dir=tokenizer_dir, mention_max_len=d.mention_max_len,
                          entity_max_len=d.entity_max_len, workers=d.prepare_workers, progress=False), log=log)
    log(summarize(out))
    return str(out)
