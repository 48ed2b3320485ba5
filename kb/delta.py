"""Change a prepared store without rebuilding it: add, remove and replace entities.

    python -m kb.delta --store data/kilt --add new_pages.json --remove gone_ids.txt
    python -m kb.delta --store data/kilt --compact --out data/kilt_v2

A delta writes KB version n+1 of the store (layout in :mod:`kb.store`) under
``<store>/versions/<n+1>/``:

* ``entities.arrow``: the added entities, rows ``count, count+1, ...`` (row ids never move,
  so every persisted embedding version, shard range and mention ``gold_row`` stays valid);
* ``tombstones.arrow``: every row removed up to this version, sorted int64;
* ``source_index.arrow``: the added rows' source ids (lookups search newer versions first).

A replaced entity is a remove plus an add of the same source id. ``--add`` takes the
entity formats ``kb.prepare`` reads (KILT knowledge source, BLINK ``entity.jsonl``, Zeshel
documents; default: the store's own) through the same chunked, multi-process ingest, with
the same bad-record rules: a malformed line, a source id repeated in the file, an id
already live in the KB that is not also removed, or an id in ``--remove`` that is not in
the KB stops with ``file:line: reason``; ``--on-bad-record skip`` counts, lists and
records them. The version directory is written to a temporary name and renamed, and the
manifest (``kb_version`` and one record per version: counts, live count, files and their
sha256, skipped lines, mention golds that changed) is written last, atomically: a killed
update leaves the store at its previous version, and running it again redoes it.

Earlier versions stay readable (``EntityStore(path, kb_version=v)``) until ``--compact``
rewrites the live rows into a fresh store with contiguous rows. Row ids change there, so
the compacted store is a new lineage: shards and snapshots must be encoded again.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist_nce.core.artifacts import MANIFEST, ArtifactMismatch, atomic_path, atomic_write_json, file_sha256
from dist_nce.core.config import AT_LEAST_1, check_fields
from dist_nce.core.flags import FlagParser, existing, number, occupied, refuse
from dist_nce.core.records import BadRecord, BadRecordLog
from kb.assemble import _PartWriter, _duplicates, load_chunks, token_stats
from kb.chunk_worker import EncodeSettings, process_chunk, tokenizer
from kb.gold_version import gold_at_version, gold_changes
from kb.ingest import ChunkTask, file_fingerprint, plan_byte_ranges, run_chunks
from kb.jsonl import read_records
from kb.prepare import CHUNK_SIZE, _skipped, input_error
from kb.prepare_config import PrepareError, parse_size
from kb.source_index import build_source_index, sort_source_keys, source_index_table
from kb.store import (ENTITIES_DIR, MENTIONS_DIR, MENTIONS_FILE, SCHEMA_VERSION, SEGMENT_FILE,
                      SOURCE_INDEX_FILE, TOMBSTONES_FILE, VERSIONS_DIR, EntityStore, MentionTable, entity_schema,
                      mention_schema, open_manifest, read_arrow, tombstone_table, version_dir,
                      write_arrow)

FORMATS = ("kilt", "blink", "zeshel")


@dataclass
class UpdateConfig:
    """One ``kb.delta`` run; unknown keys are refused by the dataclass itself."""

    store: str = field(default="", metadata={"help": "the prepared store to change"})
    add: list[str] = field(default_factory=list, metadata={"help": "entity files to add (repeatable)"})
    remove: str | None = field(default=None, metadata={"help": "a file of source ids to remove, one per line"})
    format: str | None = field(default=None, metadata={"help": "format of --add files: kilt, blink, zeshel "
                                                                "(default: the store's own)"})
    world: str | None = field(default=None, metadata={"help": "Zeshel world of added documents (default: the "
                                                               "file name's stem, as prepare does)"})
    model_dir: str | None = field(default=None, metadata={"help": "tokenizer directory (must be the store's)"})
    on_bad_record: Literal["error", "skip"] = field(default="error", metadata={"help": "error or skip"})
    workers: int = field(default=1, metadata={"help": "parallel tokenizer processes", "range": AT_LEAST_1})
    chunk_size: str = field(default="32M", metadata={"help": "bytes of input per ingest chunk"})
    compact: bool = field(default=False, metadata={"help": "write the live rows into a fresh store at --out"})
    out: str | None = field(default=None, metadata={"help": "output directory of --compact"})
    progress: bool = field(default=True, metadata={"help": "progress bar on stderr"})

    def validate(self) -> None:
        check_fields(self, "update")
        if not self.store:
            raise PrepareError("store: the prepared store to change is required")
        if self.compact:
            if self.add or self.remove:
                raise PrepareError("--compact rewrites the current version; run --add/--remove first, then compact")
            if not self.out:
                raise PrepareError("--compact needs --out (a fresh store: row ids change)")
            if Path(self.out).resolve() == Path(self.store).resolve():
                raise PrepareError("--compact --out must be another directory than --store")
        elif not self.add and not self.remove:
            raise PrepareError("nothing to do: give --add and/or --remove (or --compact)")
        if self.format is not None and self.format not in FORMATS:
            raise PrepareError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        parse_size(self.chunk_size)


# --------------------------------------------------------------------------- inputs


def read_removals(path: Path, store: EntityStore, bad: BadRecordLog) -> np.ndarray:
    """Rows to remove: one source id per line of ``path`` (blank lines skipped); an id that is
    not live in ``store`` or repeats an earlier line is a bad record. Sorted int64 ``[r]``."""
    # read_records: undecodable lines reported, blank lines and an opening byte order mark skipped
    numbered = list(read_records(path, lambda line, _path, lineno: (lineno, line.strip()), bad))
    lines, ids = [n for n, _ in numbered], [text for _, text in numbered]
    rows = store.rows_for_source_ids(ids)
    seen: dict[str, int] = {}
    keep = []
    for source_id, lineno, row in zip(ids, lines, rows):
        if source_id in seen:
            bad.report(str(path), lineno, f"source id {source_id!r} listed twice (first at line {seen[source_id]})")
        elif row < 0:
            bad.report(str(path), lineno, f"source id {source_id!r} is not in the KB at version {store.kb_version}")
        else:
            seen[source_id] = lineno
            keep.append(int(row))
    return np.unique(np.asarray(keep, dtype=np.int64))


def _add_tasks(cfg: UpdateConfig, fmt: str, spec: dict) -> list[ChunkTask]:
    tasks = []
    for f_idx, name in enumerate(cfg.add):
        path = Path(name).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: entity file to add not found")
        world = (cfg.world or path.stem) if fmt == "zeshel" else None
        source = file_fingerprint(path)
        for c_idx, (a, b) in enumerate(plan_byte_ranges(path, parse_size(cfg.chunk_size))):
            task_spec = {**spec, "reader": fmt, "source": source, "bytes": [a, b], "world": world}
            tasks.append(ChunkTask(f"add-{f_idx:03d}-{c_idx:06d}", "entities", fmt, str(path), a, b, world, b - a,
                                   task_spec))
    return tasks


def _live_collisions(chunks, table: pa.Table, store: EntityStore, removed: np.ndarray, bad: BadRecordLog
                     ) -> np.ndarray:
    """Keep-mask over ``table``: False for an id live in ``store`` and not removed by this delta."""
    ids = table.column("source_id").to_pylist()
    rows = store.rows_for_source_ids(ids)
    clash = (rows >= 0) & ~np.isin(rows, removed)
    offsets = np.cumsum([0] + [c.table.num_rows for c in chunks])
    for pos in np.flatnonzero(clash):
        c = int(np.searchsorted(offsets, pos, side="right") - 1)
        line = int(table.column("line")[int(pos)].as_py())
        bad.report(chunks[c].task.path, line,
                   f"source id {ids[pos]!r} is already in the KB at version {store.kb_version} (row {rows[pos]}); "
                   "a replacement is a remove plus an add: list it in --remove too")
    return ~clash


def _added_table(chunks, store: EntityStore, removed: np.ndarray, bad: BadRecordLog) -> pa.Table:
    """The rows to append (row ids from ``store.num_entities``), bad ones reported and dropped."""
    schema = entity_schema(store.max_len)
    if not chunks:
        return schema.empty_table()
    lines = [pc.add(c.table.column("line"), pa.scalar(c.line_base, pa.int64())) for c in chunks]
    table = pa.concat_tables([c.table.set_column(c.table.schema.get_field_index("line"), "line", line)
                              for c, line in zip(chunks, lines)])
    keys, order = sort_source_keys(table.column("source_id"))
    keep = _duplicates(chunks, keys, order, bad)
    keep &= _live_collisions(chunks, table, store, removed, bad)
    table = table.filter(pa.array(keep))
    first = store.num_entities
    return pa.table({
        "row_id": pa.array(np.arange(first, first + table.num_rows, dtype=np.int64)),
        **{name: table.column(name) for name in ("source_id", "title", "world", "line", "length", "token_ids")},
    }, schema=schema)


# --------------------------------------------------------------------------- update


def _mention_changes(path: Path, manifest: dict, before: EntityStore, after: EntityStore) -> dict:
    out = {}
    for split in manifest.get("mentions", {}):
        table = read_arrow(path / MENTIONS_DIR / split / MENTIONS_FILE)
        rows = table.column("gold_row").to_numpy()
        status = table.column("gold_status").to_pylist()
        gold_ids = table.column("gold_source_id").to_pylist()
        out[split] = gold_changes(gold_at_version(before, rows, status, gold_ids),
                                  gold_at_version(after, rows, status, gold_ids))
    return out


def update(cfg: UpdateConfig, log: Callable[[str], None] = print) -> dict:
    """Apply one delta to ``cfg.store``; return the new version's manifest record."""
    from dist_nce.core.text import tokenizer_fingerprint

    cfg.validate()
    path = Path(cfg.store).resolve()
    manifest = open_manifest(path)
    store = EntityStore.from_manifest(path, manifest)
    version = store.kb_version + 1
    tok_sha = tokenizer_fingerprint(tokenizer(cfg.model_dir))["sha256"]
    if tok_sha != manifest["tokenizer_sha256"]:
        raise PrepareError(f"{path}: prepared with tokenizer {manifest['tokenizer_sha256'][:12]}, --model-dir gives "
                           f"{tok_sha[:12]}; pass the store's tokenizer directory")
    fmt = cfg.format or manifest["source"]["format"]
    if fmt not in FORMATS:
        raise PrepareError(f"{path}: store format {fmt!r} has no entity reader; pass --format")
    bad = BadRecordLog(cfg.on_bad_record)
    removed = read_removals(Path(cfg.remove), store, bad) if cfg.remove else np.zeros(0, np.int64)

    work = path / VERSIONS_DIR / f".work-{version:05d}"
    spec = {"delta_of": manifest.get("lineage_sha256") or file_sha256(path / MANIFEST), "version": version,
            "schema_version": SCHEMA_VERSION, "tokenizer_sha256": tok_sha, "max_len": store.max_len,
            "strip_title": bool(manifest.get("zeshel_strip_title", False))}
    tasks = _add_tasks(cfg, fmt, spec)
    settings = EncodeSettings(cfg.model_dir, store.max_len, int(manifest["mention_max_len"]),
                              bool(manifest.get("zeshel_strip_title", False)), cfg.on_bad_record)
    run_id = uuid.uuid4().hex[:12]
    fn = functools.partial(process_chunk, work_dir=str(work), settings=settings, run_id=run_id)
    markers = run_chunks(tasks, work, fn, workers=cfg.workers, policy=cfg.on_bad_record, progress=cfg.progress,
                         log=log) if tasks else []
    chunks = load_chunks(work, tasks, markers)
    added = _added_table(chunks, store, removed, bad)
    if not added.num_rows and not len(removed):
        raise PrepareError(f"{path}: the delta changes nothing (every record was skipped)")

    tombstones = np.union1d(store.tombstones, removed).astype(np.int64)
    first, count = store.num_entities, store.num_entities + added.num_rows
    rel = version_dir(version)
    with atomic_path(path / rel) as tmp:
        tmp.mkdir()
        if added.num_rows:
            write_arrow(tmp / SEGMENT_FILE, added)
        keys, order = sort_source_keys(added.column("source_id"))
        write_arrow(tmp / SOURCE_INDEX_FILE, source_index_table(keys[order], first + order))
        write_arrow(tmp / TOMBSTONES_FILE, tombstone_table(tombstones))
        sha = {f.name: file_sha256(f) for f in sorted(tmp.iterdir())}
    record = {
        "version": version, "dir": rel, "count": count, "live": count - len(tombstones),
        "added": added.num_rows, "removed": int(len(removed)),
        "replaced": int(np.isin(store.source_ids(removed), added.column("source_id").to_pylist()).sum())
        if len(removed) and added.num_rows else 0,
        "segment": {"file": SEGMENT_FILE, "rows": [first, count]} if added.num_rows else None,
        "source_index": SOURCE_INDEX_FILE, "tombstones": TOMBSTONES_FILE, "sha256": sha,
        "inputs": {"format": fmt, "add": [file_fingerprint(Path(p).resolve()) for p in cfg.add],
                   "remove": file_fingerprint(Path(cfg.remove).resolve()) if cfg.remove else None},
        "skipped": _skipped(chunks, bad),
        "token_stats": token_stats(added.column("length").to_numpy(), store.max_len) if added.num_rows else None,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    new_manifest = {**manifest, "kb_version": version, "versions": [*manifest.get("versions", []), record]}
    new_manifest.setdefault("lineage_sha256", spec["delta_of"])
    after = EntityStore.from_manifest(path, new_manifest)
    record["mentions"] = _mention_changes(path, manifest, store, after)
    atomic_write_json(path / MANIFEST, new_manifest)  # last: the version exists from here on
    shutil.rmtree(work, ignore_errors=True)
    return record


# --------------------------------------------------------------------------- compaction


def compact(cfg: UpdateConfig, log: Callable[[str], None] = print) -> dict:
    """Write the live rows of ``cfg.store``'s current version into a fresh store at ``cfg.out``
    (contiguous rows, one source index, mention golds remapped); return its manifest."""
    cfg.validate()
    path, out = Path(cfg.store).resolve(), Path(cfg.out).resolve()
    if (out / MANIFEST).exists():
        raise PrepareError(f"{out} already holds a store; compact into a new directory")
    manifest = open_manifest(path)
    store = EntityStore.from_manifest(path, manifest)
    rows_per_part = int(manifest["entities"]["rows_per_part"])
    new_row = np.full(store.num_entities, -1, dtype=np.int64)
    live = np.ones(store.num_entities, dtype=bool)
    live[store.tombstones] = False
    new_row[live] = np.arange(int(live.sum()))
    staging = out.parent / f".{out.name}.compact"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / ENTITIES_DIR).mkdir(parents=True)
    writer = _PartWriter(staging / ENTITIES_DIR, rows_per_part)
    ids, lengths = [], []
    for p, table in enumerate(store._parts):
        a = int(store._starts[p])
        mask = live[a:a + table.num_rows]
        part = table.filter(pa.array(mask))
        part = part.set_column(0, "row_id", pa.array(new_row[a:a + table.num_rows][mask]))
        writer.add(part)
        ids.append(part.column("source_id").combine_chunks())
        lengths.append(part.column("length").to_numpy())
    parts = writer.close()
    write_arrow(staging / ENTITIES_DIR / SOURCE_INDEX_FILE,
                build_source_index(pa.chunked_array(ids, pa.string())))
    entities = {**manifest["entities"], "count": int(live.sum()), "parts": parts,
                "token_stats": token_stats(np.concatenate(lengths) if lengths else np.zeros(0), store.max_len),
                "worlds": {}, "duplicate_source_ids_skipped": 0}
    mentions = {}
    for split, info in manifest.get("mentions", {}).items():
        table = MentionTable(path, split)
        gold = table.gold_rows
        rows = np.where(gold >= 0, new_row[gold.clip(min=0)], -1)
        status = table.gold_status
        final = table.table.set_column(table.table.schema.get_field_index("gold_row"), "gold_row", pa.array(rows))
        final = final.set_column(final.schema.get_field_index("gold_status"), "gold_status",
                                 pa.array(status, pa.string()))
        write_arrow(staging / MENTIONS_DIR / split / MENTIONS_FILE, final.cast(mention_schema(table.max_len)))
        mentions[split] = {**info, "gold": {s: status.count(s) for s in sorted(set(status))}}
    fields = {k: v for k, v in manifest.items() if k not in ("versions", "kb_version", "lineage_sha256", "spec",
                                                             "entities", "mentions")}
    fields.update(entities=entities, mentions=mentions,
                  compacted_from={"store": str(path), "kb_version": store.kb_version,
                                  "lineage_sha256": manifest.get("lineage_sha256") or file_sha256(path / MANIFEST)},
                  created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    atomic_write_json(staging / MANIFEST, fields)
    staging.rename(out)
    log(f"{out}: compacted {store.num_live} live rows of {path} (KB version {store.kb_version}); row ids changed: "
        "this is a new store lineage, shards and snapshots must be encoded again")
    return fields


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="update_kb", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, type=existing("dir"), help="the prepared store to change")
    p.add_argument("--add", action="append", default=[], type=existing("file"),
                   help="entity file to add (repeatable)")
    p.add_argument("--remove", type=existing("file"), help="file of source ids to remove, one per line")
    p.add_argument("--format", choices=FORMATS, help="format of --add files (default: the store's)")
    p.add_argument("--world", help="Zeshel world of added documents (default: the file's stem)")
    p.add_argument("--model-dir", dest="model_dir", type=existing("dir"), help="tokenizer directory (the store's)")
    p.add_argument("--on-bad-record", dest="on_bad_record", choices=["error", "skip"], default="error")
    p.add_argument("--workers", type=number(int, AT_LEAST_1), default=1)
    p.add_argument("--chunk-size", dest="chunk_size", type=CHUNK_SIZE, default="32M")
    p.add_argument("--compact", action="store_true", help="write the live rows into a fresh store at --out")
    p.add_argument("--out", help="output directory of --compact")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def describe(record: dict) -> str:
    skipped = record["skipped"]["count"]
    lines = [f"KB version {record['version']}: +{record['added']} -{record['removed']} "
             f"({record['replaced']} replaced); {record['live']} live of {record['count']} rows"
             + (f"; {skipped} bad record(s) skipped" if skipped else "")]
    for split, m in record.get("mentions", {}).items():
        lines.append(f"  mentions {split}: {m['unresolvable']} gold(s) removed, {m['moved']} moved to a replacement, "
                     f"{m['resolved']} newly resolved")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # compact() renames its finished copy onto --out, which fails only at the end on a directory
    # holding anything; no flag allows replacing one, so the name is refused before any row is read.
    why = occupied(args.out) if args.compact and args.out else None
    if why:
        return refuse("--out", args.out, why)
    cfg = UpdateConfig(**vars(args))
    log = (lambda s: print(s, file=sys.stderr))
    try:
        if cfg.compact:
            compact(cfg, log)
        else:
            print(describe(update(cfg, log)))
    except (BadRecord, PrepareError, ArtifactMismatch, FileNotFoundError) as e:
        return input_error(e)
    except KeyboardInterrupt:  # the store is still at its last version: its manifest is written last
        if cfg.compact:
            said = f"{cfg.store} is unchanged and nothing was written to {cfg.out}; run the same command again"
        else:
            said = (f"{cfg.store} is still at its last version; the encoded chunks of this update are kept in "
                    f"{Path(cfg.store).resolve() / VERSIONS_DIR}; run the same command again to resume")
        print(f"interrupted: {said}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
