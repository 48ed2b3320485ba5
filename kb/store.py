"""The prepared store: entity table and mention tables as memory-mapped Arrow files.

Layout of a prepared directory (written by :mod:`kb.prepare`)::

    <dir>/manifest.json                    kind "prepared_kb", schema version, counts, tokenizer, ...
    <dir>/entities/part-00000.arrow ...    entity rows, ``rows_per_part`` rows per part (last may be shorter)
    <dir>/entities/source_index.arrow      source ids sorted (fixed-width bytes) -> row id
    <dir>/mentions/<split>/mentions.arrow  one mention table per split
    <dir>/versions/00001/...               KB deltas (kb.delta): appended rows, tombstones, their ids

Every Arrow file is an IPC *file* holding one record batch, opened with
``pa.memory_map``: token ids are zero-copy ``np.int32`` views ``[rows, max_len]`` of
the mapped pages, so a shard that owns 1M rows pays for the pages it touches, not
for a load. Row ``r`` lives in part ``r // rows_per_part`` at offset
``r % rows_per_part``, so a gather needs no search.

Source-id lookup (:mod:`kb.source_index`) is a vectorised ``np.searchsorted`` over
mapped fixed-width keys, not a Python dict over millions of ids.

**KB versions** (docs/design.md section 6, "Keeping the KB current"). A store is a lineage
of versions: version 0 is what ``kb.prepare`` wrote; ``kb.delta`` adds version n+1 as
appended rows (rows ``count, count+1, ...``: row ids never move), a cumulative sorted
tombstone array of removed rows, and a source index of the added rows only. An
:class:`EntityStore` opens the manifest's current ``kb_version`` unless told another one;
its row space is every row up to that version (tombstoned rows included, so persisted
embeddings, shard ranges and mention ``gold_row`` values stay valid), and its lookups
(source id, title) never return a tombstoned row.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist_nce.core.artifacts import ArtifactMismatch, atomic_path, read_manifest
from kb.arrow_view import arrow_indices, numpy_view
# The gold-status vocabulary (column ``gold_status``) lives with the rule that reads it; the
# store re-exports it as part of its own face.
from kb.gold_version import (GOLD_BY_ID, GOLD_BY_TITLE, GOLD_MISSING, GOLD_REMOVED,  # noqa: F401
                             GOLD_UNLABELLED, gold_at_version)
from kb.source_index import SourceIndex

KIND = "prepared_kb"
SCHEMA_VERSION = 1
ENTITIES_DIR = "entities"
MENTIONS_DIR = "mentions"
SOURCE_INDEX_FILE = "source_index.arrow"
MENTIONS_FILE = "mentions.arrow"
VERSIONS_DIR = "versions"
SEGMENT_FILE = "entities.arrow"  # a delta's appended rows
TOMBSTONES_FILE = "tombstones.arrow"  # cumulative removed rows of a version, sorted int64



def version_dir(version: int) -> str:
    """``versions/00001``: where KB version ``version`` (>= 1) keeps its files."""
    return f"{VERSIONS_DIR}/{int(version):05d}"


def kb_version_of(manifest: Mapping[str, Any]) -> int:
    """The current KB version a store manifest names (0 before any delta)."""
    return int(manifest.get("kb_version", 0))


def version_records(manifest: Mapping[str, Any], kb_version: int | None = None) -> list[dict]:
    """The delta records of versions 1..``kb_version`` (default: the current one), ascending;
    refuses a version the manifest does not have."""
    current = kb_version_of(manifest)
    want = current if kb_version is None else int(kb_version)
    if not 0 <= want <= current:
        raise ArtifactMismatch(f"KB version {want} does not exist (versions 0..{current})")
    records = [r for r in manifest.get("versions", []) if int(r["version"]) <= want]
    if [int(r["version"]) for r in records] != list(range(1, want + 1)):
        raise ArtifactMismatch(f"manifest lists KB versions {[r['version'] for r in records]}, expected 1..{want}")
    return records


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
    return numpy_view(column.flatten()).reshape(-1, width)


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


def read_tombstones(path: str | os.PathLike) -> np.ndarray:
    """A version's removed rows: sorted unique int64 ``[t]`` (memory-mapped)."""
    rows = numpy_view(read_arrow(path).column("row_id"))
    if len(rows) > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise ArtifactMismatch(f"{path}: tombstones are not sorted and unique")
    return rows.astype(np.int64, copy=False)


def tombstone_table(rows: np.ndarray) -> pa.Table:
    return pa.table({"row_id": pa.array(np.asarray(rows, dtype=np.int64))})


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
                 expect: Mapping[str, Any] | None = None, kb_version: int | None = None):
        self._load(Path(path), open_manifest(path, tokenizer_sha256, expect), kb_version)

    @classmethod
    def from_manifest(cls, path: str | os.PathLike, manifest: dict, kb_version: int | None = None
                      ) -> "EntityStore":
        """Open with an in-memory manifest (used while the store is being assembled,
        before its manifest.json is written)."""
        store = object.__new__(cls)
        store._load(Path(path), manifest, kb_version)
        return store

    def _load(self, path: Path, manifest: dict, kb_version: int | None = None) -> None:
        self.path = path
        self.manifest = manifest
        ent = manifest["entities"]
        self.max_len = int(manifest["entity_max_len"])
        self.rows_per_part = int(ent["rows_per_part"])
        base = int(ent["count"])
        self._parts: list[pa.Table] = []
        starts = []
        files = []
        for i, name in enumerate(ent["parts"]):
            file = path / ENTITIES_DIR / name
            table = _one_batch(read_arrow(file))
            expected_rows = min(self.rows_per_part, base - i * self.rows_per_part)
            if table.num_rows != expected_rows:
                raise ArtifactMismatch(f"{file}: {table.num_rows} rows, manifest says {expected_rows}")
            self._parts.append(table)
            starts.append(i * self.rows_per_part)
            files.append(file)
        self.records = version_records(manifest, kb_version)
        self.kb_version = int(self.records[-1]["version"]) if self.records else 0
        total = base
        index_files = [path / ENTITIES_DIR / SOURCE_INDEX_FILE]
        for rec in self.records:  # appended segments, in row order
            seg = rec.get("segment")
            if seg is None:
                continue
            a, b = seg["rows"]
            file = path / rec["dir"] / seg["file"]
            table = _one_batch(read_arrow(file))
            if a != total or table.num_rows != b - a:
                raise ArtifactMismatch(f"{file}: {table.num_rows} rows at {total}, manifest says rows [{a}, {b})")
            self._parts.append(table)
            starts.append(a)
            files.append(file)
            index_files.append(path / rec["dir"] / rec["source_index"])
            total = b
        self._total = total
        self._starts = np.asarray(starts, dtype=np.int64)
        self._tokens = [token_view(t.column("token_ids")) if t.num_rows else np.zeros((0, self.max_len), np.int32)
                        for t in self._parts]
        for file, tok in zip(files, self._tokens):
            if tok.shape[1] != self.max_len:
                raise ArtifactMismatch(f"{file}: token width {tok.shape[1]}, manifest says {self.max_len}")
        self._lengths = [numpy_view(t.column("length")) for t in self._parts]
        self._index_files = index_files
        self._index: list[SourceIndex] | None = None
        if self.records:
            rec = self.records[-1]
            self._dead = read_tombstones(path / rec["dir"] / rec["tombstones"])
        else:
            self._dead = np.zeros(0, np.int64)
        self.start, self.stop = 0, self._total

    # -- versions
    @property
    def tombstones(self) -> np.ndarray:
        """Sorted int64 rows of this view (its row ids) removed at this KB version."""
        lo, hi = np.searchsorted(self._dead, [self.start, self.stop])
        return self._dead[lo:hi] - self.start

    @property
    def num_live(self) -> int:
        """Entities not removed at this KB version (rows of this view)."""
        return self.num_entities - len(self.tombstones)

    def is_live(self, rows: Any) -> np.ndarray:
        """bool, same shape as ``rows`` (this view's row ids): False where tombstoned."""
        return self._live_global(self._global(rows))

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

    def _locate(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global rows -> (part, offset in the part): base parts and appended segments alike."""
        part = np.searchsorted(self._starts, flat, side="right") - 1
        return part, flat - self._starts[part]

    def _gather(self, arrays: list[np.ndarray], rows: Any, tail: tuple[int, ...]) -> np.ndarray:
        g = self._global(rows)
        flat = g.ravel()
        part, offset = self._locate(flat)
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
        part, offset = self._locate(flat)
        values: list = [None] * len(flat)
        for p in np.unique(part):
            sel = np.flatnonzero(part == p)
            taken = self._parts[p].column(name).take(arrow_indices(offset[sel])).to_pylist()
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
            p = int(np.searchsorted(self._starts, pos, side="right") - 1)
            off = pos - int(self._starts[p])
            end = min(self.stop, pos + batch_size, int(self._starts[p]) + self._parts[p].num_rows)
            n = end - pos
            yield (np.arange(pos, end, dtype=np.int64) - self.start,
                   self._tokens[p][off : off + n], self._lengths[p][off : off + n])
            pos = end

    # -- lookups
    def rows_for_source_ids(self, ids: Sequence[str]) -> np.ndarray:
        """Source ids -> int64 row ids of this view; -1 where absent, removed at this KB
        version, or outside the view.

        The newest version that added an id names its row (a replaced entity's id maps to
        its new row); ids are unique among live rows (``kb.delta`` refuses an add of a live
        id), so a tombstoned hit means the id is not in this version.
        """
        if self._index is None:
            self._index = [SourceIndex(read_arrow(f)) for f in self._index_files]
        ids = list(ids)
        rows = np.full(len(ids), -1, dtype=np.int64)
        for index in reversed(self._index):
            todo = np.flatnonzero(rows < 0)
            if not len(todo):
                break
            rows[todo] = index.lookup([ids[i] for i in todo])
        found = rows >= 0
        if found.any():
            live = np.zeros(len(rows), dtype=bool)
            live[found] = self._live_global(rows[found])
            rows = np.where(live, rows, -1)
        inside = (rows >= self.start) & (rows < self.stop)
        return np.where(inside, rows - self.start, -1)

    def _live_global(self, g: np.ndarray) -> np.ndarray:
        if not len(self._dead):
            return np.ones(g.shape, dtype=bool)
        pos = np.searchsorted(self._dead, g).clip(max=len(self._dead) - 1)
        return self._dead[pos] != g

    def rows_for_titles(self, titles: Sequence[str], counts: list[int] | None = None) -> np.ndarray:
        """Titles -> int64 row ids (first live row with that exact title), -1 where absent.

        counts: a list to extend with how many live rows hold each title (> 1: the title is
        ambiguous, and the first row was taken). A scan of the title column: meant for
        preparing data (resolving a few thousand gold titles), not for a training loop.
        """
        wanted = pa.array(list(dict.fromkeys(titles)), pa.string())
        found: dict[str, int] = {}
        seen: dict[str, int] = {}
        for p, table in enumerate(self._parts):
            first = int(self._starts[p])
            lo = max(self.start - first, 0)
            hi = min(self.stop - first, table.num_rows)
            if lo >= hi:
                continue
            col = table.column("title").slice(lo, hi - lo)
            hits = np.flatnonzero(pc.is_in(col, value_set=wanted).to_numpy(zero_copy_only=False))
            if len(hits):
                hits = hits[self._live_global(first + lo + hits)]
            for i, title in zip(hits, col.take(arrow_indices(hits)).to_pylist()):
                found.setdefault(title, first + lo + int(i) - self.start)
                seen[title] = seen.get(title, 0) + 1
        if counts is not None:
            counts.extend(seen.get(t, 0) for t in titles)
        return np.array([found.get(t, -1) for t in titles], dtype=np.int64)


class MentionTable:
    """One split's mentions from a prepared directory (memory-mapped).

    Golds are those of the KB version read (default: the current one): a gold removed by a
    delta reads -1 with status ``removed``, a replaced or newly added one its live row
    (:mod:`kb.gold_version` gives the rule); ``prepared_gold_rows`` keeps the column as written.
    """

    def __init__(self, path: str | os.PathLike, split: str, *, tokenizer_sha256: str | None = None,
                 expect: Mapping[str, Any] | None = None, kb_version: int | None = None):
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
        records = version_records(self.manifest, kb_version)
        self.kb_version = int(records[-1]["version"]) if records else 0
        self._gold = None
        if self.kb_version:
            store = EntityStore.from_manifest(self.path, self.manifest, self.kb_version)
            self._gold = gold_at_version(store, self.prepared_gold_rows, self.table.column("gold_status").to_pylist(),
                                         self.table.column("gold_source_id").to_pylist())

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
        return numpy_view(col) if self.table.num_rows else np.zeros(0, np.int64)

    @property
    def prepared_gold_rows(self) -> np.ndarray:
        """int64 ``[N]`` as prepared (KB version 0)."""
        return self._numpy("gold_row")

    @property
    def gold_rows(self) -> np.ndarray:
        """int64 ``[N]`` at this table's KB version, -1 where the gold entity is not in the KB
        (or removed from it) or unlabelled."""
        return self.prepared_gold_rows if self._gold is None else self._gold[0]

    @property
    def lengths(self) -> np.ndarray:
        return self._numpy("length")

    @property
    def mention_ids(self) -> list[str]:
        return self.table.column("mention_id").to_pylist()

    @property
    def gold_status(self) -> list[str]:
        return self.table.column("gold_status").to_pylist() if self._gold is None else list(self._gold[1])

    @property
    def worlds(self) -> list[str | None]:
        return self.table.column("world").to_pylist()

    @property
    def categories(self) -> list[str | None]:
        return self.table.column("category").to_pylist()
