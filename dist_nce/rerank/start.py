"""What a reranker run started from ``model.init_from`` trains with: the job's settings over the checkpoint's.

The weights hold neither the pair length nor the score head's dropout, so the job's ``model.reranker`` gives
them (``max_len``, ``dropout``, ``trim_padding``), and its ``layout`` where set; unset, the checkpoint's own
layout stays (a saved directory's manifest, the ``.layout.json`` our export writes beside a BLINK file, else
BLINK's). The head is the weights': one the config names differently is refused. Before, a checkpoint's own
max_len was trained with while the run printed, checked on resume and exported the config's.

:func:`check_start` reads only the small files beside the weights, so the job refuses a start before any
cluster work; the workers apply the same :func:`job_config` to the reranker they load.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from dist_nce.core.config import ConfigError, from_dict
from dist_nce.modeling.reranker import RerankerConfig

_LAYOUT = ("layout", "context_len", "cand_len")


def job_config(got: RerankerConfig, want: RerankerConfig, source: str, max_pos: int | None = None) -> RerankerConfig:
    """The config a run trains the checkpoint at ``source`` with: ``got``, the checkpoint's own, under the job's
    ``want`` (module docstring). ``max_pos``: the encoder's ``max_position_embeddings``, when known. Raises
    ConfigError naming the key."""
    if got.head != want.head:
        raise ConfigError(f"model.reranker.head: {want.head!r}, but model.init_from {source} holds a {got.head!r} "
                          f"head; set model.reranker.head: {got.head}")
    keep = {} if want.layout is None else {k: getattr(want, k) for k in _LAYOUT}
    config = dataclasses.replace(got, max_len=want.max_len, dropout=want.dropout, trim_padding=want.trim_padding,
                                 **keep)
    try:
        config.validate()
    except ValueError as e:
        raise ConfigError(f"model.reranker: {e} (the layout of model.init_from {source})") from None
    if max_pos is not None and config.max_len > max_pos:
        raise ConfigError(f"model.reranker.max_len: {config.max_len} exceeds the max_position_embeddings {max_pos} "
                          f"of model.init_from {source}")
    return config


def checkpoint_config(path: str | os.PathLike, want: RerankerConfig) -> tuple[RerankerConfig, int | None]:
    """(the checkpoint's own config, its encoder's max_position_embeddings or None), read from the files beside
    the weights: a saved directory's manifest and encoder config, or a BLINK file's layout and architecture
    records (BLINK's own files have none: BLINK's layout, the pooler head, ``want``'s lengths)."""
    from dist_nce.modeling.blink import read_architecture_file
    from dist_nce.modeling.blink_crossencoder import ENCODER_ATTR, read_layout_file

    p = Path(path)
    if p.is_dir():
        from dist_nce.core.artifacts import read_manifest
        from dist_nce.modeling.reranker import MANIFEST_KIND

        manifest = read_manifest(p, MANIFEST_KIND)
        got = from_dict(RerankerConfig, manifest["config"], f"{p / 'manifest.json'}: config")
        encoder = p / "encoder" / "config.json"
        max_pos = json.loads(encoder.read_text(encoding="utf-8")).get("max_position_embeddings") \
            if encoder.is_file() else None
        return got, max_pos
    recorded = read_layout_file(p) or {"layout": "blink", "context_len": want.context_len,
                                        "cand_len": want.cand_len}
    got = dataclasses.replace(want, head="pooler", **recorded)
    max_pos = read_architecture_file(p).get(ENCODER_ATTR, {}).get("max_position_embeddings")
    return got, max_pos


def check_start(path: str | os.PathLike, want: RerankerConfig) -> None:
    """ConfigError for a start the workers would refuse (:func:`job_config`), read from the small files only."""
    got, max_pos = checkpoint_config(path, want)
    job_config(got, want, os.fspath(path), max_pos)
