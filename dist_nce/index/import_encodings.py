"""Precomputed entity encodings in (BLINK's ``all_entities_large.t7``, a ``.npy``) as shard versions.

A matrix of one row per entity is converted, shard by shard, into the persisted version a
shard would have written had it encoded those rows itself (``index.versions``): same
directory layout, same identity (rows, store, score spec, storage dtype, d), and the
``encoder_fingerprint`` of the entity encoder the rows came from. Shards started on that
directory therefore serve it as it is: ``serve_model`` and ``NegativeService.ensure_encoded``
find the version of "these weights" and encode nothing (a training run starts from it as
version 0).

Memory: the matrix is never loaded. Rows are read with positioned reads
(``index.matrix_file``) ``chunk_rows`` at a time, converted to the storage dtype and
appended to the shard's safetensors file (``PersistedVersions.save_streamed``): the resident
set is a chunk of the file's rows and the converted chunk, whatever the matrix's size.

Alignment: the matrix's row i must be the store's row i, unless its ids are given (BLINK's
``entity.jsonl``, whose line order is the row order of its encodings): then each store row
takes the row of its ``source_id``, and a store entity the file lacks is an error naming it.

The model is not loaded either when it is a BLINK ``.bin`` (:func:`blink_source_model`): its
entity encoder's fingerprint is read off the mapped file a tensor at a time
(``dist_nce.modeling.blink_stream``), the same digest the loaded model gives.

A killed import leaves a version directory half written under a temporary name; the next
write to that shard removes it (``PersistedVersions.sweep_temps``), as it removes any
other writer's that died, and never a live writer's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from dist_nce.index.encode import state_fingerprint
from dist_nce.index.matrix_file import MatrixFile, read_rows
from dist_nce.index.versions import PersistedVersions, shard_dir_name, shard_identity
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from kb.store import EntityStore

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ID_CHUNK = 1 << 20  # store rows whose ids are held at once while aligning


class AlignmentError(ValueError):
    """The matrix's rows cannot be matched to the store's rows; the message says which."""


def read_row_ids(path: str | os.PathLike) -> list[str]:
    """The ids of a matrix's rows, in row order: BLINK's ``entity.jsonl`` (a line's ``idx`` curid,
    i.e. its wikipedia_id), or a text file of one id per line. A bad line is an error naming it:
    skipping it would shift every later row."""
    path = Path(path)
    if path.suffix == ".jsonl":
        from kb.blink import parse_blink_entity

        ids = []
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark opening it, as prepare reads it
            for lineno, line in enumerate(f, 1):
                ids.append(parse_blink_entity(line, str(path), lineno).source_id)
        return ids
    with open(path, encoding="utf-8-sig") as f:
        ids = [line.strip() for line in f]
    for lineno, value in enumerate(ids, 1):
        if not value:
            raise AlignmentError(f"{path}:{lineno}: empty id")
    return ids


def _as_int_ids(ids: Sequence[str]) -> np.ndarray | None:
    """ids as int64 when every one is a plain non-negative integer (wikipedia ids), else None:
    5.9M ids then take 47 MB instead of a dict of Python strings."""
    if not all(i.isdigit() and len(i) < 19 for i in ids):
        return None
    return np.array([int(i) for i in ids], dtype=np.int64)


def _twice(ids_source: str, value: object, first: int, second: int) -> str:
    return (f"{ids_source}: id {value} names matrix rows {first} and {second} (counting from 0: its ids number "
            f"{first + 1:,} and {second + 1:,})")


def align_rows(matrix: MatrixFile, store: EntityStore, ids: Sequence[str] | None, ids_source: str = "--ids"
               ) -> np.ndarray | None:
    """The matrix row of each store row [n] (int64), or None when they are the same rows.

    ``ids``: the matrix's row ids in order (:func:`read_row_ids`), or None: then the row
    counts must agree and row i is taken as store row i. Raises :class:`AlignmentError`
    naming the first store entities the matrix lacks, or duplicated ids."""
    n = store.num_entities
    if ids is None:
        if matrix.rows != n:
            raise AlignmentError(f"{matrix.describe()}: {matrix.rows:,} rows, but the store has {n:,} entities; "
                                 "give the ids of the matrix's rows (BLINK's entity.jsonl) to align them by id")
        return None
    if len(ids) != matrix.rows:
        raise AlignmentError(f"{ids_source}: {len(ids):,} ids for the {matrix.rows:,} rows of {matrix.describe()}")
    as_int = _as_int_ids(ids)
    if as_int is not None:
        order = np.argsort(as_int, kind="stable")
        keys = as_int[order]
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if dup.size:
            raise AlignmentError(_twice(ids_source, keys[dup[0]], int(order[dup[0]]), int(order[dup[0] + 1])))
    else:
        where: dict[str, int] = {}
        for i, value in enumerate(ids):
            if where.setdefault(value, i) != i:
                raise AlignmentError(_twice(ids_source, repr(value), where[value], i))
    row_of = np.empty(n, dtype=np.int64)
    missing: list[str] = []
    n_missing = 0
    for a in range(0, n, _ID_CHUNK):
        b = min(n, a + _ID_CHUNK)
        chunk = [str(s) for s in store.source_ids(np.arange(a, b))]
        if as_int is not None:  # a store id that is not an integer is simply absent from the matrix
            wanted = np.array([int(v) if v.isdigit() and len(v) < 19 else -1 for v in chunk], dtype=np.int64)
            pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
            found = np.where((keys[pos] == wanted) & (wanted >= 0), order[pos], -1)
        else:
            found = np.array([where.get(v, -1) for v in chunk], dtype=np.int64)
        row_of[a:b] = found
        lost = np.flatnonzero(found < 0)
        n_missing += lost.size
        missing += [f"row {a + i} (id {chunk[i]})" for i in lost[: max(0, 5 - len(missing))]]
    if n_missing:
        raise AlignmentError(f"{ids_source}: {n_missing:,} store entities have no row in {matrix.describe()}, "
                             f"e.g. {', '.join(missing)}; prepare the store from the same entities "
                             "(jobs/prepare_kb.py --blink-entities)")
    return None if np.array_equal(row_of, np.arange(n)) else row_of


def _runs(rows: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(position in ``rows``, first matrix row, count) of each run of consecutive rows."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield s, int(rows[s]), e - s


def shard_chunks(matrix: MatrixFile, row_of: np.ndarray | None, rows: tuple[int, int], dtype: torch.dtype,
                 chunk_rows: int, progress: Callable[[int], None] | None = None) -> Iterator[torch.Tensor]:
    """Store rows [a, b) of the matrix, ``chunk_rows`` at a time, as CPU ``dtype`` tensors [c, d]."""
    a, b = rows
    buf = np.empty((min(chunk_rows, max(b - a, 1)), matrix.dim), dtype=matrix.dtype)
    with open(matrix.path, "rb", buffering=0) as f:
        for s in range(a, b, chunk_rows):
            e = min(b, s + chunk_rows)
            out = buf[: e - s]
            if row_of is None:
                read_rows(matrix, s, e, out, file=f)
            else:
                for pos, first, count in _runs(row_of[s:e]):
                    read_rows(matrix, first, first + count, out[pos:pos + count], file=f)
            t = torch.from_numpy(out)
            t = t.view(torch.bfloat16) if matrix.bfloat16 else t
            yield t.to(dtype)  # a copy in the storage dtype (or out itself for fp32 -> fp32: written at once)
            if progress is not None:
                progress(e - s)


@dataclass(frozen=True)
class SourceModel:
    """What the import needs of the model the encodings came from (not its weights)."""

    config: RetrieverConfig
    hidden_size: int
    tokenizer: Any
    encoder_fingerprint: str
    streamed: bool  # fingerprinted off the file, no model built


def loaded_source_model(retriever: Retriever) -> SourceModel:
    return SourceModel(retriever.config, retriever.hidden_size, retriever.tokenizer,
                       state_fingerprint(retriever.entity_encoder_state()), streamed=False)


def blink_source_model(path: str | os.PathLike, config: RetrieverConfig,
                       tokenizer_dir: str | os.PathLike | None = None) -> SourceModel | None:
    """The :class:`SourceModel` of ``load_blink_retriever(path, config, tokenizer_dir)`` without
    building it (module docstring), or None where the file must be loaded whole."""
    from dist_nce.modeling.blink import blink_tokenizer
    from dist_nce.modeling.blink_stream import blink_entity_state

    streamed = blink_entity_state(path, config)
    if streamed is None:
        return None
    tokenizer = blink_tokenizer(path, tokenizer_dir or config.mention_model, streamed.vocab_size)
    return SourceModel(config, streamed.hidden_size, tokenizer, state_fingerprint(streamed.state), streamed=True)


@dataclass(frozen=True)
class ImportTarget:
    """Where and as what the shards' version 0 is written (what the serving shards will expect)."""

    shard_root: Path
    ranges: list[tuple[int, int]]
    store_fingerprint: str
    spec: dict[str, Any]
    storage_dtype: str
    encoder_fingerprint: str


def import_matrix(matrix: MatrixFile, row_of: np.ndarray | None, target: ImportTarget, version: int = 0,
                  chunk_rows: int = 16384, progress: Callable[[int], None] | None = None,
                  **fields: Any) -> list[dict]:
    """Write ``version`` of every shard of ``target`` from ``matrix``; returns their manifests.

    A shard that already holds ``version`` from the same encoder (an interrupted import run
    again) is kept as it is, so a rerun resumes where the last finished shard left off."""
    dtype = TORCH_DTYPES[target.storage_dtype]
    manifests = []
    for shard, rows in enumerate(target.ranges):
        versions = PersistedVersions(target.shard_root / shard_dir_name(shard, len(target.ranges)), shard_identity(
            rows, target.store_fingerprint, target.spec, target.storage_dtype, matrix.dim))
        if version in versions.valid_versions():
            done = versions.manifest(version)
            if done.get("encoder_fingerprint") == target.encoder_fingerprint:
                versions.sweep_temps()  # a write sweeps; a finished shard is not written, so sweep it here
                manifests.append(done)
                if progress is not None:
                    progress(rows[1] - rows[0])
                continue
            raise FileExistsError(f"{versions.path(version)} holds version {version} of another encoder; "
                                  "choose another output directory")
        manifests.append(versions.save_streamed(
            version, (rows[1] - rows[0], matrix.dim), dtype,
            shard_chunks(matrix, row_of, rows, dtype, chunk_rows, progress),
            encoder_fingerprint=target.encoder_fingerprint, origin_fingerprint=target.encoder_fingerprint,
            kb_version=0, **fields))
    return manifests
