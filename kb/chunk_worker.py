"""One ingest chunk: parse its lines with the format's reader, tokenize, write Arrow.

Runs in a worker process (or in-process with one worker). The tokenizer is loaded
once per process. Output columns are those of :mod:`kb.store` minus what only the
assembly knows (global row ids and line numbers, gold rows).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa

from dist_nce.core.records import BadRecord, BadRecordLog
from kb.ingest import ChunkTask, RangeRecords, output_path, write_marker
from kb.store import token_array, write_arrow

# Records tokenized per call inside a chunk: bounds a worker's memory, not its speed.
ENCODE_BATCH = 1024
# Skipped lines listed per chunk marker (and in the manifest); counts stay exact.
SKIPPED_LIST_CAP = 1000
# Seconds to pause between writing a chunk and its marker. For tests only: it widens
# the window in which the kill-and-resume test interrupts a run. Unset in real use.
TEST_DELAY_ENV = "DIST_NCE_INGEST_TEST_DELAY"


@dataclass(frozen=True)
class EncodeSettings:
    """What a worker needs besides its task (picklable)."""

    model_dir: str | None
    entity_max_len: int
    mention_max_len: int
    strip_title: bool
    policy: str


_TOKENIZERS: dict[str | None, Any] = {}


def tokenizer(model_dir: str | None):
    """One tokenizer per process and model directory (workers load it on first use), without
    transformers where the directory allows: a worker only tokenizes (dist_nce.core.rust_tokenizer)."""
    if model_dir not in _TOKENIZERS:
        from dist_nce.core.text import load_ingest_tokenizer

        _TOKENIZERS[model_dir] = load_ingest_tokenizer(model_dir)
    return _TOKENIZERS[model_dir]


def _records(task: ChunkTask, bad: BadRecordLog) -> tuple[Iterable, Callable[[], int]]:
    """(record iterator, () -> lines read) for a task."""
    if task.kind == "entities":
        if task.reader == "kilt":
            from kb.kilt import parse_kilt_entity as parse
        elif task.reader == "blink":
            from kb.blink import parse_blink_entity as parse
        elif task.reader == "zeshel":
            from kb.zeshel import parse_zeshel_document

            parse = functools.partial(parse_zeshel_document, world=task.arg)
        else:
            raise ValueError(f"unknown entity reader {task.reader!r}")
        records = RangeRecords(task.path, task.start, task.end, parse, bad)
        return records, lambda: records.lines
    if task.reader == "aida":
        from kb.kilt import iter_aida

        return iter_aida(task.path, bad), lambda: 0
    if task.reader == "zeshel_mentions":
        from kb.zeshel import iter_zeshel_mentions

        return iter_zeshel_mentions(task.path, task.arg, bad), lambda: 0
    raise ValueError(f"unknown mention reader {task.reader!r}")


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _lengths(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    # Rows are [CLS] ... [SEP] then padding, so the non-pad count is the length.
    return (tokens != pad_id).sum(axis=1).astype(np.int32)


def _entity_table(records: list, tokens: np.ndarray, pad_id: int) -> pa.Table:
    return pa.table({
        "source_id": pa.array([r.source_id for r in records], pa.string()),
        "title": pa.array([r.title for r in records], pa.string()),
        "world": pa.array([r.world for r in records], pa.string()),
        "line": pa.array([r.line for r in records], pa.int64()),
        "length": pa.array(_lengths(tokens, pad_id)),
        "token_ids": token_array(tokens),
    })


def _mention_table(records: list, tokens: np.ndarray, pad_id: int) -> pa.Table:
    return pa.table({
        "mention_id": pa.array([r.mention_id for r in records], pa.string()),
        "mention": pa.array([r.mention for r in records], pa.string()),
        "length": pa.array(_lengths(tokens, pad_id)),
        "token_ids": token_array(tokens),
        "gold_source_id": pa.array([r.gold_source_id for r in records], pa.string()),
        "gold_title": pa.array([r.gold_title for r in records], pa.string()),
        "world": pa.array([r.world for r in records], pa.string()),
        "category": pa.array([r.category for r in records], pa.string()),
        "line": pa.array([r.line for r in records], pa.int64()),
    })


def process_chunk(task: ChunkTask, work_dir: str, settings: EncodeSettings, run_id: str) -> dict:
    """Parse and tokenize one chunk, write ``<name>.arrow`` then its marker; return the
    marker, or ``{"bad": ...}`` when the error policy meets a malformed line."""
    from dist_nce.core.text import encode_entities, encode_mentions

    delay = float(os.environ.get(TEST_DELAY_ENV) or 0)
    tok = tokenizer(settings.model_dir)
    bad = BadRecordLog(settings.policy)
    t0 = time.perf_counter()
    records, lines = _records(task, bad)
    tables = []
    try:
        for batch in _batches(records, ENCODE_BATCH):
            if task.kind == "entities":
                ids = encode_entities(tok, batch, settings.entity_max_len, settings.strip_title)
                tables.append(_entity_table(batch, ids, tok.pad_token_id))
            else:
                ids = encode_mentions(tok, batch, settings.mention_max_len)
                tables.append(_mention_table(batch, ids, tok.pad_token_id))
    except BadRecord as e:
        return {"bad": {"path": e.path, "line": e.line, "reason": e.reason}}
    if not tables:
        max_len = settings.entity_max_len if task.kind == "entities" else settings.mention_max_len
        empty = np.zeros((0, max_len), np.int32)
        tables.append((_entity_table if task.kind == "entities" else _mention_table)([], empty, 0))
    table = pa.concat_tables(tables)
    write_arrow(output_path(work_dir, task), table)
    if delay:
        time.sleep(delay)
    result = {"rows": table.num_rows, "lines": lines(), "seconds": round(time.perf_counter() - t0, 3),
              "skipped_count": bad.count, "skipped": bad.skipped[:SKIPPED_LIST_CAP]}
    return write_marker(work_dir, task, run_id, result)
