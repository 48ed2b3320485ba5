"""Assemble finished ingest chunks into the prepared store (see :mod:`kb.store` for the layout).

Runs once every chunk is done. Entities: chunks are concatenated in task order into
parts of ``rows_per_part`` rows with global row ids and global line numbers, a source
id that repeats an earlier one is a bad record (the first occurrence keeps the id),
and the sorted source index is written. Mentions: each split's gold reference is
resolved to a row, by source id first and then by title, and every unresolved mention
is kept with ``gold_row = -1`` and counted.

Memory: the chunk files are memory-mapped; what is held at once is one part (e.g.
262,144 rows x 128 ids = 128 MiB) plus one fixed-width key per entity for sorting.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist_nce.core.records import BadRecordLog
from kb.ingest import ChunkTask, line_bases, output_path
from kb.source_index import sort_source_keys, source_index_table
from kb.store import (ENTITIES_DIR, GOLD_BY_ID, GOLD_BY_TITLE, GOLD_MISSING, GOLD_UNLABELLED, MENTIONS_DIR,
                      MENTIONS_FILE, SOURCE_INDEX_FILE, EntityStore, entity_schema, mention_schema, part_file,
                      read_arrow, write_arrow)

# Mention ids listed per split in the manifest when their gold entity is missing.
MISSING_LIST_CAP = 10_000


@dataclass
class Chunk:
    task: ChunkTask
    marker: dict
    table: pa.Table
    line_base: int


def load_chunks(work_dir: Path, tasks: Sequence[ChunkTask], markers: Sequence[dict]) -> list[Chunk]:
    bases = line_bases(tasks, markers)
    return [Chunk(t, m, read_arrow(output_path(work_dir, t)), b) for t, m, b in zip(tasks, markers, bases)]


def token_stats(lengths: np.ndarray, max_len: int) -> dict:
    """Length statistics of padded token rows (for the manifest and the summary)."""
    if not len(lengths):
        return {"mean": 0.0, "max": 0, "min": 0, "truncated_fraction": 0.0}
    return {"mean": round(float(lengths.mean()), 2), "max": int(lengths.max()), "min": int(lengths.min()),
            "truncated_fraction": round(float((lengths >= max_len).mean()), 4)}


class _PartWriter:
    """Cut a stream of tables into parts of exactly ``rows_per_part`` rows (last: rest)."""

    def __init__(self, directory: Path, rows_per_part: int):
        self.directory, self.rows_per_part = directory, rows_per_part
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.names: list[str] = []

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        while self.pending_rows >= self.rows_per_part:
            joined = pa.concat_tables(self.pending)
            self._write(joined.slice(0, self.rows_per_part))
            rest = joined.slice(self.rows_per_part)
            self.pending, self.pending_rows = [rest], rest.num_rows

    def close(self) -> list[str]:
        if self.pending_rows:
            self._write(pa.concat_tables(self.pending))
        self.pending, self.pending_rows = [], 0
        return self.names

    def _write(self, table: pa.Table) -> None:
        name = part_file(len(self.names))
        write_arrow(self.directory / name, table)
        self.names.append(name)


def _locate(chunks: Sequence[Chunk], positions: np.ndarray) -> list[tuple[Chunk, int]]:
    """Positions in the concatenation of all chunks -> (chunk, row within it)."""
    offsets = np.cumsum([0] + [c.table.num_rows for c in chunks])
    idx = np.searchsorted(offsets, positions, side="right") - 1
    return [(chunks[i], int(p - offsets[i])) for i, p in zip(idx, positions)]


def _where(chunk: Chunk, row: int) -> tuple[str, int]:
    return chunk.task.path, int(chunk.table.column("line")[row].as_py()) + chunk.line_base


def _duplicates(chunks: Sequence[Chunk], keys: np.ndarray, order: np.ndarray, bad: BadRecordLog) -> np.ndarray:
    """Keep-mask over all rows: False for a source id seen at an earlier row, each
    reported to ``bad`` (under the error policy, the earliest one raises)."""
    keep = np.ones(len(keys), dtype=bool)
    sorted_keys = keys[order]
    new_run = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]] if len(keys) else np.zeros(0, bool)
    dup_sorted = np.flatnonzero(~new_run)
    if not len(dup_sorted):
        return keep
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(len(keys)), 0))
    dup_pos, first_pos = order[dup_sorted], order[run_start[dup_sorted]]
    by_position = np.argsort(dup_pos, kind="stable")
    dup_pos, first_pos = dup_pos[by_position], first_pos[by_position]
    for (chunk, row), (first_chunk, first_row) in zip(_locate(chunks, dup_pos), _locate(chunks, first_pos)):
        path, line = _where(chunk, row)
        first_path, first_line = _where(first_chunk, first_row)
        source_id = chunk.table.column("source_id")[row].as_py()
        at = f"line {first_line}" if first_path == path else f"{first_path}:{first_line}"
        bad.report(path, line, f"duplicate source id {source_id!r} (first at {at})")
    keep[dup_pos] = False
    return keep


def _world_runs(world: pa.ChunkedArray, offset: int, runs: list[list]) -> None:
    """Append (world, start, end) runs of ``world`` (rows from ``offset``), merging with the last run."""
    if not len(world):
        return
    ree = pc.run_end_encode(world.combine_chunks())
    start = offset
    for value, end in zip(ree.values.to_pylist(), ree.run_ends.to_pylist()):
        if runs and runs[-1][0] == value and runs[-1][2] == start:
            runs[-1][2] = offset + end
        else:
            runs.append([value, start, offset + end])
        start = offset + end


def assemble_entities(out_dir: Path, chunks: Sequence[Chunk], max_len: int, rows_per_part: int,
                      bad: BadRecordLog) -> dict:
    """Write ``entities/part-*.arrow`` and ``entities/source_index.arrow``; return the
    manifest's ``entities`` section."""
    ent_dir = out_dir / ENTITIES_DIR
    ent_dir.mkdir(parents=True, exist_ok=True)
    for stale in ent_dir.glob("*.arrow"):
        stale.unlink()
    ids = pa.chunked_array([c.table.column("source_id").combine_chunks() for c in chunks], pa.string())
    keys, order = sort_source_keys(ids)
    keep = _duplicates(chunks, keys, order, bad)
    new_row = np.cumsum(keep) - 1

    writer = _PartWriter(ent_dir, rows_per_part)
    schema = entity_schema(max_len)
    files: dict[str, list[int]] = {}
    runs: list[list] = []
    lengths = []
    row, pos = 0, 0
    for chunk in chunks:
        table = chunk.table
        mask = keep[pos:pos + table.num_rows]
        pos += table.num_rows
        if not mask.all():
            table = table.filter(pa.array(mask))
        n = table.num_rows
        table = pa.table({
            "row_id": pa.array(np.arange(row, row + n, dtype=np.int64)),
            "source_id": table.column("source_id"),
            "title": table.column("title"),
            "world": table.column("world"),
            "line": pc.add(table.column("line"), pa.scalar(chunk.line_base, pa.int64())),
            "length": table.column("length"),
            "token_ids": table.column("token_ids"),
        }, schema=schema)
        writer.add(table)
        span = files.setdefault(chunk.task.path, [row, row])
        span[1] = row + n
        _world_runs(table.column("world"), row, runs)
        lengths.append(table.column("length").to_numpy())
        row += n
    parts = writer.close()

    kept_sorted = keep[order]
    index = source_index_table(keys[order][kept_sorted], new_row[order][kept_sorted])
    write_arrow(ent_dir / SOURCE_INDEX_FILE, index)

    worlds = {w: [a, b] for w, a, b in runs if w is not None}
    if len(worlds) != sum(w is not None for w, _, _ in runs):
        worlds = {}  # a world in several runs has no single row range
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    return {
        "count": row,
        "rows_per_part": rows_per_part,
        "parts": parts,
        "source_index": {"file": SOURCE_INDEX_FILE, "key_bytes": int(keys.dtype.itemsize)},
        "files": [{"path": p, "rows": r} for p, r in files.items()],
        "worlds": worlds,
        "duplicate_source_ids_skipped": int((~keep).sum()),
        "token_stats": token_stats(all_lengths, max_len),
    }


def _resolve(store: EntityStore, gold_ids: list, gold_titles: list) -> tuple[np.ndarray, list[str], list[int]]:
    """Gold rows and how each was resolved: by source id, else by title, else missing; and the
    mentions resolved by a title that more than one entity has (the first of them was taken)."""
    n = len(gold_ids)
    rows = np.full(n, -1, dtype=np.int64)
    status = [GOLD_UNLABELLED] * n
    labelled = [i for i in range(n) if gold_ids[i] is not None or gold_titles[i] is not None]
    with_id = [i for i in labelled if gold_ids[i] is not None]
    if with_id:
        rows[with_id] = store.rows_for_source_ids([gold_ids[i] for i in with_id])
    by_title = [i for i in labelled if rows[i] < 0 and gold_titles[i] is not None]
    counts: list[int] = []
    if by_title:
        rows[by_title] = store.rows_for_titles([gold_titles[i] for i in by_title], counts)
    ambiguous = [i for i, c in zip(by_title, counts) if c > 1]
    title_set = set(by_title)
    for i in labelled:
        status[i] = GOLD_MISSING if rows[i] < 0 else (GOLD_BY_TITLE if i in title_set else GOLD_BY_ID)
    return rows, status, ambiguous


def _repeated_mention_ids(chunk: Chunk, bad: BadRecordLog) -> pa.Table:
    """``chunk.table`` without the rows whose mention id an earlier row of the split has, each reported to
    ``bad`` (under the error policy the first raises). Ids compare as KILT compares them (stripped strings):
    KILT scores a guess file keyed by id, and linking reports answer by id."""
    first: dict[str, int] = {}
    keep = np.ones(chunk.table.num_rows, dtype=bool)
    for row, mention_id in enumerate(chunk.table.column("mention_id").to_pylist()):
        key = str(mention_id).strip()
        if key in first:
            path, line = _where(chunk, row)
            first_line = _where(chunk, first[key])[1]
            bad.report(path, line, f"duplicate mention id {mention_id!r} (first at line {first_line})")
            keep[row] = False
        else:
            first[key] = row
    return chunk.table if keep.all() else chunk.table.filter(pa.array(keep))


def assemble_mentions(out_dir: Path, split: str, chunk: Chunk, store: EntityStore, max_len: int,
                      bad: BadRecordLog) -> dict:
    """Write ``mentions/<split>/mentions.arrow``; return the split's manifest section."""
    table = _repeated_mention_ids(chunk, bad)
    gold_ids = table.column("gold_source_id").to_pylist()
    gold_titles = table.column("gold_title").to_pylist()
    rows, status, ambiguous = _resolve(store, gold_ids, gold_titles)
    worlds = table.column("world").to_pylist()
    resolved = np.flatnonzero(rows >= 0)
    entity_worlds = store.worlds(rows[resolved]) if len(resolved) else []
    world_mismatch = sum(1 for i, w in zip(resolved, entity_worlds)
                         if worlds[i] is not None and w is not None and worlds[i] != w)
    final = pa.table({
        "mention_id": table.column("mention_id"),
        "mention": table.column("mention"),
        "length": table.column("length"),
        "token_ids": table.column("token_ids"),
        "gold_row": pa.array(rows),
        "gold_status": pa.array(status, pa.string()),
        "gold_source_id": table.column("gold_source_id"),
        "gold_title": table.column("gold_title"),
        "world": table.column("world"),
        "category": table.column("category"),
        "line": table.column("line"),
    }, schema=mention_schema(max_len))
    write_arrow(out_dir / MENTIONS_DIR / split / MENTIONS_FILE, final)
    ids = table.column("mention_id").to_pylist()
    missing = [ids[i] for i, s in enumerate(status) if s == GOLD_MISSING]
    lengths = table.column("length").to_numpy() if table.num_rows else np.zeros(0, np.int32)
    return {
        "count": table.num_rows,
        "file": f"{MENTIONS_DIR}/{split}/{MENTIONS_FILE}",
        "source": chunk.task.path,
        "gold": {s: status.count(s) for s in (GOLD_BY_ID, GOLD_BY_TITLE, GOLD_MISSING, GOLD_UNLABELLED)},
        "missing_gold": {"count": len(missing), "mention_ids": missing[:MISSING_LIST_CAP],
                         "listed": min(len(missing), MISSING_LIST_CAP)},
        # golds found by a title several entities share: the first such entity (lowest row) was taken
        "ambiguous_title": {"count": len(ambiguous), "mention_ids": [ids[i] for i in ambiguous[:MISSING_LIST_CAP]],
                            "listed": min(len(ambiguous), MISSING_LIST_CAP)},
        "gold_world_mismatch": world_mismatch,
        "token_stats": token_stats(lengths, max_len),
    }
