"""Chunked, multi-process, resumable ingest machinery (format- and tokenizer-agnostic).

A big JSON-lines file is cut into byte ranges that start at line starts
(:func:`plan_byte_ranges`); each :class:`ChunkTask` is processed by a worker that
writes its own output file and then a small done-marker ``<name>.json`` (both
atomically). A rerun reuses every chunk whose marker records exactly the same
``spec`` (source fingerprint, byte range, tokenizer hash, lengths, code version), so
an interrupted ingest resumes where it stopped and the final store is assembled only
when every chunk is done.

Line numbers: a worker numbers the lines of its range from 1 (it cannot know how many
lines precede it without reading them). Reports are turned into global 1-based line
numbers afterwards: from the other chunks' line counts (:func:`line_bases`) or, for
an error that stops the run early, by counting newlines before the chunk.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from dist_nce.core.artifacts import atomic_write_json
from dist_nce.core.records import BadRecord, BadRecordLog
from kb.jsonl import UTF8_BOM
from kb.parent_watch import exit_with_parent

T = TypeVar("T")

_SAMPLE_BYTES = 1 << 16
_SAMPLES = 16


def file_fingerprint(path: str | os.PathLike) -> dict:
    """``{"path", "size", "sample_sha256"}``: a cheap identity for a possibly 35 GB file.

    The hash covers the size and 16 evenly spaced 64 KiB samples (first and last
    included), so it costs ~1 MiB of reads; an edit that keeps the size and misses
    every sample goes unnoticed, which is the price of not hashing 35 GB.
    """
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        span = max(size - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            f.seek(span * i // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE_BYTES))
    return {"path": str(path.resolve()), "size": size, "sample_sha256": h.hexdigest()}


def path_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a file's or a directory's files' names, sizes and sampled content
    (:func:`file_fingerprint`, its path left out: a moved copy is the same input); the string
    itself for what is not on this disk (a hub name, a URI). What a run read, by content: a model
    rebuilt in place at the same path is another model."""
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p] if p.is_file() else []
    parts = [(str(q.relative_to(p)) if q != p else q.name,
              {k: v for k, v in file_fingerprint(q).items() if k != "path"}) for q in files]
    return hashlib.sha256(json.dumps(parts or os.fspath(path)).encode()).hexdigest()


def plan_byte_ranges(path: str | os.PathLike, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut ``path`` into ``[start, end)`` byte ranges of about ``chunk_bytes`` that start
    at line starts; together they cover the file exactly (no ranges for an empty file)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk_bytes}")
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        target = chunk_bytes
        while target < size:
            # The line holding byte target-1 ends the chunk; the next line starts the next.
            f.seek(target - 1)
            f.readline()
            cut = f.tell()
            if cut >= size:
                break
            bounds.append(cut)
            target = cut + chunk_bytes
    if size:
        bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


def count_newlines(path: str | os.PathLike, start: int, end: int, block: int = 1 << 24) -> int:
    """Number of ``\\n`` bytes in ``[start, end)`` of ``path``."""
    n = 0
    with open(path, "rb") as f:
        f.seek(start)
        remaining = end - start
        while remaining > 0:
            data = f.read(min(block, remaining))
            if not data:
                break
            n += data.count(b"\n")
            remaining -= len(data)
    return n


class RangeRecords:
    """Iterate ``parse(line, path, lineno)`` over the lines in bytes ``[start, end)``.

    Same rules as :func:`kb.jsonl.read_records` (blank lines skipped, undecodable
    lines reported, ``parse`` errors routed to ``bad``) except that ``lineno`` is local
    to the range (1 = the line at ``start``). After iteration ``.lines`` holds the
    number of lines in the range.
    """

    def __init__(self, path: str, start: int, end: int, parse: Callable[[str, str, int], T],
                 bad: BadRecordLog):
        self.path, self.start, self.end, self.parse, self.bad = str(path), start, end, parse, bad
        self.lines = 0

    def __iter__(self) -> Iterator[T]:
        pos = self.start
        with open(self.path, "rb") as f:
            f.seek(self.start)
            for raw in f:
                if pos >= self.end:
                    break
                pos += len(raw)
                self.lines += 1
                if self.start == 0 and self.lines == 1:
                    raw = raw.removeprefix(UTF8_BOM)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    self.bad.report(self.path, self.lines, f"not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield self.parse(line, self.path, self.lines)
                except BadRecord as e:
                    self.bad.report(e.path, e.line, e.reason)


@dataclass(frozen=True)
class ChunkTask:
    """One unit of ingest work and the identity of its output.

    ``start``/``end`` is a byte range of ``path`` whose line numbers are local (see the
    module docstring); ``end == -1`` means a whole source read by a streaming reader
    that numbers lines globally itself. ``spec`` is everything the output depends on.
    """

    name: str
    kind: str
    reader: str
    path: str
    start: int = 0
    end: int = -1
    arg: str | None = None
    weight: int = 0
    spec: dict = field(default_factory=dict, compare=False)

    @property
    def local_lines(self) -> bool:
        return self.end >= 0 and self.start > 0


def marker_path(work_dir: str | os.PathLike, task: ChunkTask) -> Path:
    return Path(work_dir) / f"{task.name}.json"


def output_path(work_dir: str | os.PathLike, task: ChunkTask) -> Path:
    return Path(work_dir) / f"{task.name}.arrow"


def write_marker(work_dir: str | os.PathLike, task: ChunkTask, run_id: str, result: dict) -> dict:
    """Record a finished chunk; call after its output file is in place."""
    out = output_path(work_dir, task)
    marker = {"task": task.name, "spec": task.spec, "run": run_id, "output": out.name,
              "output_bytes": out.stat().st_size, "result": result}
    atomic_write_json(marker_path(work_dir, task), marker)
    return marker


def load_marker(work_dir: str | os.PathLike, task: ChunkTask, policy: str) -> dict | None:
    """The marker of a completed chunk that can be reused for ``task``, else None.

    A chunk that skipped bad lines is not reused under the ``error`` policy: that run
    must stop at the bad line instead.
    """
    path = marker_path(work_dir, task)
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    out = output_path(work_dir, task)
    if marker.get("spec") != json.loads(json.dumps(task.spec)):
        return None
    if not out.exists() or out.stat().st_size != marker.get("output_bytes"):
        return None
    if policy == "error" and marker["result"].get("skipped_count", 0):
        return None
    return marker


def line_bases(tasks: Sequence[ChunkTask], markers: Sequence[dict]) -> list[int]:
    """Lines preceding each task in its file, from the line counts of completed chunks
    (``result["lines"]``); tasks that number lines globally get 0."""
    before: dict[str, int] = {}
    bases = []
    for task, marker in zip(tasks, markers):
        if task.end < 0:
            bases.append(0)
            continue
        base = before.get(task.path, 0)
        bases.append(base)
        before[task.path] = base + int(marker["result"]["lines"])
    return bases


def _global_bad(task: ChunkTask, bad: dict) -> BadRecord:
    line = bad["line"]
    if task.local_lines and bad["path"] == task.path:
        line += count_newlines(task.path, 0, task.start)
    return BadRecord(bad["path"], line, bad["reason"])


def _init_pool_worker(parent_pid: int) -> None:
    # A worker outliving a killed job would hold its memory forever (kb.parent_watch).
    exit_with_parent(parent_pid)
    # Each of N worker processes tokenizes on one core; the tokenizer's own thread pool
    # (and any OpenMP) would oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["OMP_NUM_THREADS"] = "1"


def _remove_partial_outputs(work_dir: str | os.PathLike) -> None:
    # A worker killed mid-write leaves the temporary file it was writing (outputs are
    # renamed into place only when complete); nothing else writes into this directory
    # while a run is starting, so every such file is garbage.
    for tmp in Path(work_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def run_chunks(
    tasks: Sequence[ChunkTask],
    work_dir: str | os.PathLike,
    fn: Callable[[ChunkTask], dict],
    *,
    workers: int = 1,
    policy: str = "error",
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run ``fn`` on every task without a reusable marker; return all markers in task order.

    ``fn(task)`` writes the output and marker and returns the marker, or returns
    ``{"bad": {"path", "line", "reason"}}`` when the ``error`` policy stops at a bad
    line. The earliest bad line in task order is raised as :class:`BadRecord` with a
    global line number, whatever the number of workers; finished chunks keep their markers.
    With ``workers > 1``, ``fn`` must be picklable (a module-level function or a
    ``functools.partial`` of one).
    """
    from tqdm.auto import tqdm

    Path(work_dir).mkdir(parents=True, exist_ok=True)
    _remove_partial_outputs(work_dir)
    markers: list[dict | None] = [load_marker(work_dir, t, policy) for t in tasks]
    todo = [i for i, m in enumerate(markers) if m is None]
    if len(todo) < len(tasks):
        log(f"resuming: {len(tasks) - len(todo)} of {len(tasks)} chunks already done in {work_dir}")
    bar = tqdm(total=sum(t.weight for t in tasks), initial=sum(t.weight for t, m in zip(tasks, markers) if m),
               unit="B", unit_scale=True, desc="ingest", disable=not progress or not todo)
    bads: list[tuple[int, BadRecord]] = []

    def finish(i: int, result: dict) -> None:
        if "bad" in result:
            bads.append((i, _global_bad(tasks[i], result["bad"])))
        else:
            markers[i] = result
        bar.update(tasks[i].weight)

    try:
        if workers <= 1:
            for i in todo:
                finish(i, fn(tasks[i]))
                if bads:
                    break
        else:
            ctx = multiprocessing.get_context("spawn")
            pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_pool_worker,
                                          initargs=(os.getpid(),))
            try:
                futures = {pool.submit(fn, tasks[i]): i for i in todo}
                pending = set(futures)
                while pending:
                    done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        if not fut.cancelled():
                            finish(futures[fut], fut.result())
                    if bads:
                        # Drop the chunks after the first failing one; those before it still
                        # run (one may hold an earlier bad line), so the error reported is the
                        # same as with one worker. Running chunks finish and keep their markers.
                        first_bad = min(i for i, _ in bads)
                        for fut in pending:
                            if futures[fut] > first_bad:
                                fut.cancel()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            # Every result is in: let the workers' interpreter teardown (seconds with torch
            # imported) overlap with assembly instead of waiting for it.
            pool.shutdown(wait=False)
    finally:
        bar.close()
    if bads:
        raise min(bads, key=lambda b: (b[0], b[1].line))[1]
    return markers  # type: ignore[return-value]
