"""The prepared store: entity table and mention tables as memory-mapped Arrow files.

Layout of a prepared directory (written by :mod:`kb.prepare`)::

    <dir>/manifest.json                    kind "prepared_kb", schema version, counts, tokenizer, ...
    <dir>/entities/part-00000.arrow ...    entity rows, ``rows_per_part`` rows per part (last may be shorter)
    <dir>/entities/source_index.arrow      source ids sorted (fixed-width bytes) -> row id
    <dir>/mentions/<split>/mentions.arrow  one mention table per split

Every Arrow file is an IPC *file* holding one record batch, opened with
``pa.memory_map``: token ids are zero-copy ``np.int32`` views ``[rows, max_len]`` of
the mapped pages, so a shard that owns 1M rows pays for the pages it touches, not
for a load. Row ``r`` lives in part ``r // rows_per_part`` at offset
``r % rows_per_part``, so a gather needs no search.

Source-id lookup (:mod:`kb.source_index`) is a vectorised ``np.searchsorted`` over
mapped fixed-width keys, not a Python dict over millions of ids.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist_nce.artifacts import ArtifactMismatch, atomic_path, read_manifest
from kb.source_index import SourceIndex

KIND = "prepared_kb"
SCHEMA_VERSION = 1
ENTITIES_DIR = "entities"
MENTIONS_DIR = "mentions"
SOURCE_INDEX_FILE = "source_index.arrow"
MENTIONS_FILE = "mentions.arrow"

# How a mention's gold reference was resolved to an entity row (column ``gold_status``).
GOLD_BY_ID = "id"  # gold source id found in the KB
GOLD_BY_TITLE = "title"  # id absent, gold title found (AIDA titles that KILT renamed keep their id)
GOLD_MISSING = "missing"  # labelled, but the gold entity is not in the KB: gold_row == -1
GOLD_UNLABELLED = "unlabelled"  # the source has no gold (aidayago2-test_without_answers): gold_row == -1


def part_file(index: int) -> str:
    return f"part-{index:05d}.arrow"


def entity_schema(max_len: int) -> pa.Schema:
    """Entity rows. ``token_ids`` is ``[CLS] title [unused2] description [SEP]`` padded to
    ``max_len``; ``line`` is the 1-based line of the source file (``manifest["entities"]["files"]``
    gives each file's row range)."""
    return pa.schema(
        [
            pa.field("row_id", pa.int64(), nullable=False),
            pa.field("source_id", pa.string(), nullable=False),
            pa.field("title", pa.string(), nullable=False),
            pa.field("world", pa.string()),
            pa.field("line", pa.int64(), nullable=False),
            pa.field("length", pa.int32(), nullable=False),
            pa.field("token_ids", pa.list_(pa.int32(), max_len), nullable=False),
        ]
    )


def mention_schema(max_len: int) -> pa.Schema:
    """Mention rows. ``gold_row`` is -1 unless ``gold_status`` is "id" or "title"."""
    return pa.schema(
        [
            pa.field("mention_id", pa.string(), nullable=False),
            pa.field("mention", pa.string(), nullable=False),
            pa.field("length", pa.int32(), nullable=False),
            pa.field("token_ids", pa.list_(pa.int32(), max_len), nullable=False),
            pa.field("gold_row", pa.int64(), nullable=False),
            pa.field("gold_status", pa.string(), nullable=False),
            pa.field("gold_source_id", pa.string()),
            pa.field("gold_title", pa.string()),
            pa.field("world", pa.string()),
            pa.field("category", pa.string()),
            pa.field("line", pa.int64(), nullable=False),
        ]
    )


# --------------------------------------------------------------------------- Arrow I/O


def token_array(tokens: np.ndarray) -> pa.FixedSizeListArray:
    """``[N, L]`` int32 -> Arrow ``FixedSizeList<int32>[L]`` (no copy of the ids)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"token ids must be [N, L], got shape {tokens.shape}")
    return pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), tokens.shape[1])


def token_view(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Zero-copy ``[N, L]`` int32 view of a ``FixedSizeList<int32>[L]`` column of one chunk."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks != 1:
            raise ValueError(f"expected one chunk, got {column.num_chunks}")
        column = column.chunk(0)
    width = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=True)
    return flat.reshape(-1, width)


def write_arrow(path: str | os.PathLike, table: pa.Table) -> None:
    """Write ``table`` as an Arrow IPC file of ONE record batch, atomically."""
    batch = table.combine_chunks().to_batches()
    with atomic_path(path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            for b in batch or [pa.RecordBatch.from_pylist([], schema=table.schema)]:
                writer.write_batch(b)


def read_arrow(path: str | os.PathLike) -> pa.Table:
    """Memory-map an Arrow IPC file; buffers point into the mapping (no read, no copy)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing Arrow file (prepared store incomplete?)")
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    return reader.read_all()


def _one_batch(table: pa.Table) -> pa.Table:
    if any(col.num_chunks > 1 for col in table.columns):
        # Written by someone else; keep working, at the cost of one copy.
        return table.combine_chunks()
    return table


# --------------------------------------------------------------------------- readers


def open_manifest(path: str | os.PathLike, tokenizer_sha256: str | None = None,
                  expect: Mapping[str, Any] | None = None) -> dict:
    """Read and check ``<path>/manifest.json`` of a prepared store."""
    checks = dict(expect or {})
    if tokenizer_sha256 is not None:
        checks["tokenizer_sha256"] = tokenizer_sha256
    try:
        return read_manifest(path, kind=KIND, schema_version=SCHEMA_VERSION, expect=checks)
    except ArtifactMismatch as e:
        raise ArtifactMismatch(
            f"{e}\n  the prepared store at {path} does not match this code/model; "
            f"re-run jobs/prepare_kb.py for it (schema version {SCHEMA_VERSION})"
        ) from None


def _as_rows(rows: Any) -> np.ndarray:
    arr = np.asarray(rows)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return arr.astype(np.int64)
        raise TypeError(f"row ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class EntityStore:
    """Memory-mapped access to the entity rows of a prepared directory.

    ``EntityStore(dir, tokenizer_sha256=...)`` refuses a store built with another
    tokenizer, another schema version, or whose ``expect`` fields differ. Row ids are
    global; on a :meth:`slice` they are local to the slice (0 = its first row).
    """

    def __init__(self, path: str | os.PathLike, *, tokenizer_sha256: str | None = None,
                 expect: Mapping[str, Any] | None = None):
        self._load(Path(path), open_manifest(path, tokenizer_sha256, expect))

    @classmethod
    def from_manifest(cls, path: str | os.PathLike, manifest: dict) -> "EntityStore":
        """Open with an in-memory manifest (used while the store is being assembled,
        before its manifest.json is written)."""
        store = object.__new__(cls)
        store._load(Path(path), manifest)
        return store

    def _load(self, path: Path, manifest: dict) -> None:
        self.path = path
        self.manifest = manifest
        ent = manifest["entities"]
        self.max_len = int(manifest["entity_max_len"])
        self.rows_per_part = int(ent["rows_per_part"])
        self._total = int(ent["count"])
        self._parts: list[pa.Table] = []
        for i, name in enumerate(ent["parts"]):
            file = path / ENTITIES_DIR / name
            table = _one_batch(read_arrow(file))
            expected_rows = min(self.rows_per_part, self._total - i * self.rows_per_part)
            if table.num_rows != expected_rows:
                raise ArtifactMismatch(f"{file}: {table.num_rows} rows, manifest says {expected_rows}")
            self._parts.append(table)
        self._tokens = [token_view(t.column("token_ids")) for t in self._parts]
        for name, tok in zip(ent["parts"], self._tokens):
            if tok.shape[1] != self.max_len:
                raise ArtifactMismatch(f"{path / ENTITIES_DIR / name}: token width {tok.shape[1]}, "
                                       f"manifest says {self.max_len}")
        self._lengths = [t.column("length").chunk(0).to_numpy(zero_copy_only=True) for t in self._parts]
        self._index: SourceIndex | None = None
        self.start, self.stop = 0, self._total

    # -- shape
    @property
    def num_entities(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.num_entities

    def slice(self, a: int, b: int) -> "EntityStore":
        """A view of rows ``[a, b)`` (in this view's row ids); shards own such ranges."""
        if not 0 <= a <= b <= self.num_entities:
            raise IndexError(f"slice [{a}, {b}) out of range for {self.num_entities} entities")
        view = object.__new__(EntityStore)
        view.__dict__.update(self.__dict__)
        view.start, view.stop = self.start + a, self.start + b
        return view

    def world_ranges(self) -> dict[str, tuple[int, int]]:
        """World -> its row range in this view (Zeshel stores each world contiguously)."""
        out = {}
        for world, (a, b) in self.manifest["entities"].get("worlds", {}).items():
            a, b = max(a, self.start) - self.start, min(b, self.stop) - self.start
            if a < b:
                out[world] = (a, b)
        return out

    # -- gathers
    def _global(self, rows: Any) -> np.ndarray:
        arr = _as_rows(rows)
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_entities):
            bad = arr[(arr < 0) | (arr >= self.num_entities)].ravel()[0]
            raise IndexError(f"row id {bad} out of range [0, {self.num_entities}) of {self.path}")
        return arr + self.start

    def _gather(self, arrays: list[np.ndarray], rows: Any, tail: tuple[int, ...]) -> np.ndarray:
        g = self._global(rows)
        flat = g.ravel()
        part, offset = np.divmod(flat, self.rows_per_part)
        out = np.empty((len(flat),) + tail, dtype=np.int32)
        for p in np.unique(part):
            sel = part == p
            out[sel] = arrays[p][offset[sel]]
        return out.reshape(g.shape + tail)

    def token_ids(self, rows: Any) -> np.ndarray:
        """``rows`` of any shape ``S`` -> int32 ``[*S, max_len]`` (pad-filled)."""
        return self._gather(self._tokens, rows, (self.max_len,))

    def lengths(self, rows: Any) -> np.ndarray:
        """``rows`` of shape ``S`` -> int32 ``[*S]`` number of non-pad tokens."""
        return self._gather(self._lengths, rows, ())

    def _column(self, name: str, rows: Any) -> list:
        g = self._global(rows)
        flat = g.ravel()
        part, offset = np.divmod(flat, self.rows_per_part)
        values: list = [None] * len(flat)
        for p in np.unique(part):
            sel = np.flatnonzero(part == p)
            taken = self._parts[p].column(name).take(pa.array(offset[sel])).to_pylist()
            for i, v in zip(sel, taken):
                values[i] = v
        if g.ndim == 1:
            return values
        return np.array(values, dtype=object).reshape(g.shape).tolist()

    def titles(self, rows: Any) -> list:
        return self._column("title", rows)

    def source_ids(self, rows: Any) -> list:
        return self._column("source_id", rows)

    def worlds(self, rows: Any) -> list:
        return self._column("world", rows)

    def iter_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Yield ``(rows [b], token_ids [b, L], lengths [b])`` over this view in row order;
        batches never straddle a part, so token ids are zero-copy views."""
        pos = self.start
        while pos < self.stop:
            p, off = divmod(pos, self.rows_per_part)
            end = min(self.stop, pos + batch_size, (p + 1) * self.rows_per_part)
            n = end - pos
            yield (np.arange(pos, end, dtype=np.int64) - self.start,
                   self._tokens[p][off : off + n], self._lengths[p][off : off + n])
            pos = end

    # -- lookups
    def rows_for_source_ids(self, ids: Sequence[str]) -> np.ndarray:
        """Source ids -> int64 row ids of this view; -1 where absent (or outside the view)."""
        if self._index is None:
            self._index = SourceIndex(read_arrow(self.path / ENTITIES_DIR / SOURCE_INDEX_FILE))
        rows = self._index.lookup(list(ids))
        inside = (rows >= self.start) & (rows < self.stop)
        return np.where(inside, rows - self.start, -1)

    def rows_for_titles(self, titles: Sequence[str]) -> np.ndarray:
        """Titles -> int64 row ids (first row with that exact title), -1 where absent.

        A scan of the title column: meant for preparing data (resolving a few thousand
        gold titles), not for a training loop.
        """
        wanted = pa.array(list(dict.fromkeys(titles)), pa.string())
        found: dict[str, int] = {}
        for p, table in enumerate(self._parts):
            lo = max(self.start - p * self.rows_per_part, 0)
            hi = min(self.stop - p * self.rows_per_part, table.num_rows)
            if lo >= hi:
                continue
            col = table.column("title").slice(lo, hi - lo)
            hits = np.flatnonzero(pc.is_in(col, value_set=wanted).to_numpy(zero_copy_only=False))
            for i, title in zip(hits, col.take(pa.array(hits)).to_pylist()):
                found.setdefault(title, p * self.rows_per_part + lo + int(i) - self.start)
        return np.array([found.get(t, -1) for t in titles], dtype=np.int64)


class MentionTable:
    """One split's mentions from a prepared directory (memory-mapped)."""

    def __init__(self, path: str | os.PathLike, split: str, *, tokenizer_sha256: str | None = None,
                 expect: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.split = split
        self.manifest = open_manifest(self.path, tokenizer_sha256, expect)
        splits = self.manifest.get("mentions", {})
        if split not in splits:
            raise KeyError(f"{self.path}: no mention split {split!r}; prepared splits: {sorted(splits)}")
        self.info = splits[split]
        self.max_len = int(self.manifest["mention_max_len"])
        self.table = _one_batch(read_arrow(self.path / MENTIONS_DIR / split / MENTIONS_FILE))
        if self.table.num_rows != self.info["count"]:
            raise ArtifactMismatch(f"{self.path}/{MENTIONS_DIR}/{split}: {self.table.num_rows} rows, "
                                   f"manifest says {self.info['count']}")
        self._tokens = token_view(self.table.column("token_ids")) if self.table.num_rows else \
            np.zeros((0, self.max_len), np.int32)

    @property
    def num_mentions(self) -> int:
        return self.table.num_rows

    def __len__(self) -> int:
        return self.num_mentions

    def token_ids(self, idx: Any) -> np.ndarray:
        """Mention indices of any shape ``S`` -> int32 ``[*S, max_len]``."""
        return self._tokens[_as_rows(idx)]

    def _numpy(self, name: str) -> np.ndarray:
        col = self.table.column(name)
        return col.to_numpy() if self.table.num_rows else np.zeros(0, np.int64)

    @property
    def gold_rows(self) -> np.ndarray:
        """int64 ``[N]``, -1 where the gold entity is not in the KB or unlabelled."""
        return self._numpy("gold_row")

    @property
    def lengths(self) -> np.ndarray:
        return self._numpy("length")

    @property
    def mention_ids(self) -> list[str]:
        return self.table.column("mention_id").to_pylist()

    @property
    def gold_status(self) -> list[str]:
        return self.table.column("gold_status").to_pylist()

    @property
    def worlds(self) -> list[str | None]:
        return self.table.column("world").to_pylist()

    @property
    def categories(self) -> list[str | None]:
        return self.table.column("category").to_pylist()
