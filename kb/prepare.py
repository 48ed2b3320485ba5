"""Prepare a knowledge base: a source in its real format -> the Arrow store of :mod:`kb.store`.

Sources (exactly one KB; mentions where the source has them)::

    python -m kb.prepare --kilt-ks kilt_knowledgesource.json --aida-dir AIDA/ --out data/kilt
    python -m kb.prepare --zeshel-root zeshel/ --zeshel-strip-title --mention-max-len 128 --out data/zeshel
    python -m kb.prepare --zeshel-root zeshel/ --zeshel-worlds train \\
        --zeshel-splits train,heldout_train_seen,heldout_train_unseen --out data/zeshel_train
    python -m kb.prepare --blink-entities entity.jsonl --aida-dir AIDA/ --out data/blink

Entity files are cut into byte-range chunks that ``--workers`` processes parse and
tokenize in parallel (:mod:`kb.ingest`); a killed run resumes from its completed
chunks when the same command is run again. The store is assembled (:mod:`kb.assemble`)
and ``manifest.json`` written only when every chunk is done, so a directory with a
manifest is always complete. ``--overwrite`` builds the replacement beside the old
store and swaps it in only when it is complete (:mod:`kb.staging`).

Paths in the manifest (source files, skipped records, mention sources) are absolute,
as the source fingerprints always were: a store is used from other working
directories (Ray workers, ``ray job submit --working-dir``) than the one it was
prepared in.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple

from dist_nce.core.artifacts import MANIFEST, ArtifactMismatch, write_manifest
from dist_nce.core.flags import FlagParser, checked, missing_input, number
from dist_nce.core.records import BadRecord, BadRecordLog
from kb.assemble import Chunk, assemble_entities, assemble_mentions, load_chunks
from kb.chunk_worker import SKIPPED_LIST_CAP, EncodeSettings, process_chunk, tokenizer
from kb.ingest import ChunkTask, file_fingerprint, plan_byte_ranges, run_chunks
from kb.input_checks import EmptyInput, ambiguity_warning, check_not_empty, gold_resolution, resolution_warning
from kb.prepare_config import PrepareConfig, PrepareError, items, parse_size
from kb.staging import recover, staging_dir, swap_in
from kb.store import KIND, MENTIONS_DIR, SCHEMA_VERSION, EntityStore
from kb.summary import summarize

__all__ = ["PrepareConfig", "PrepareError", "parse_size", "prepare", "ensure_store", "derived_from", "summarize",
           "build_parser", "main", "AIDA_FILES"]

# Bump when chunk contents change meaning, so old chunks are not reused.
INGEST_VERSION = 1
WORK_DIR = "chunks"
AIDA_FILES = {"train": "aidayago2-train-kilt.jsonl", "dev": "aidayago2-dev-kilt.jsonl",
              "test": "aidayago2-test_without_answers-kilt.jsonl"}


# --------------------------------------------------------------------------- planning


def _require_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: {what} not found")
    return p.resolve()


def _entity_files(cfg: PrepareConfig) -> list[tuple[str, Path, str | None]]:
    """(reader, absolute file, world) for every entity file, in row order."""
    if cfg.kilt_ks:
        return [("kilt", _require_file(cfg.kilt_ks, "KILT knowledge source"), None)]
    if cfg.blink_entities:
        return [("blink", _require_file(cfg.blink_entities, "BLINK entity.jsonl"), None)]
    from kb.zeshel import document_paths

    root = Path(cfg.zeshel_root).resolve()
    worlds = cfg.zeshel_world_list
    if worlds is not None:
        # A split name stands for those of its worlds that have documents (a tree may hold a
        # subset, as synthetic ones do); a world named explicitly must have them.
        named = set(items(cfg.zeshel_worlds, "zeshel_worlds"))
        doc_dir = root / "documents"
        worlds = [w for w in worlds if w in named or (doc_dir / f"{w}.json").is_file()]
        if not worlds:
            raise FileNotFoundError(f"{doc_dir}: no document file for any world of {cfg.zeshel_worlds!r}")
    return [("zeshel", p, p.stem) for p in document_paths(root, worlds)]


def _zeshel_splits(cfg: PrepareConfig, root: Path, log: Callable[[str], None]) -> list[str]:
    """The mention splits to read: those named (each must exist), else those present."""
    from kb.zeshel import ZESHEL_SPLITS

    mention_dir = root / "mentions"
    present = [s for s in ZESHEL_SPLITS if (mention_dir / f"{s}.json").is_file()]
    chosen = cfg.zeshel_split_list
    if chosen is not None:
        missing = [s for s in chosen if s not in present]
        if missing:
            raise FileNotFoundError(f"{mention_dir}: missing {', '.join(s + '.json' for s in missing)} (named by "
                                    f"--zeshel-splits; present: {', '.join(present) or 'none'})")
        return chosen
    if not present:
        raise FileNotFoundError(f"{mention_dir}: no mention split found (expected some of "
                                f"{', '.join(s + '.json' for s in ZESHEL_SPLITS)})")
    absent = [s for s in ZESHEL_SPLITS if s not in present]
    if absent:
        log(f"{mention_dir}: preparing the mention splits present ({', '.join(present)}); not found: "
            f"{', '.join(s + '.json' for s in absent)}")
    return present


def _mention_sources(cfg: PrepareConfig, log: Callable[[str], None]) -> list[tuple[str, str, Path, list[Path]]]:
    """(split, reader, absolute file, files its content depends on) per mention split."""
    if cfg.aida_dir:
        d = Path(cfg.aida_dir).resolve()
        found = [(s, d / f) for s, f in AIDA_FILES.items() if (d / f).is_file()]
        # KILT's own names only (the test split has no answers there): a file named otherwise is not read,
        # and saying so beats a split that is silently missing
        other = sorted(f.name for f in d.glob("aidayago2-*-kilt.jsonl") if f.name not in AIDA_FILES.values())
        if not found:
            raise FileNotFoundError(f"{d}: none of {sorted(AIDA_FILES.values())} found"
                                    + (f" (not read: {', '.join(other)})" if other else ""))
        if other:
            log(f"WARNING: {d}: not read: {', '.join(other)}; the splits are read from KILT's file names "
                f"{', '.join(AIDA_FILES.values())} (rename a file to prepare it as that split)")
        return [(s, "aida", p, [p]) for s, p in found]
    if cfg.zeshel_root:
        from kb.zeshel import document_paths

        root = Path(cfg.zeshel_root).resolve()
        docs = document_paths(root)
        return [(s, "zeshel_mentions", root / "mentions" / f"{s}.json", [root / "mentions" / f"{s}.json", *docs])
                for s in _zeshel_splits(cfg, root, log)]
    return []


class Plan(NamedTuple):
    entity_files: list[tuple[str, Path, str | None]]  # (reader, file, world)
    entity_tasks: list[ChunkTask]  # in row order
    mention_tasks: list[tuple[str, ChunkTask, Path]]  # (split, task, the split's file)
    fingerprints: list[dict]  # every source file


def plan(cfg: PrepareConfig, tokenizer_sha256: str, log: Callable[[str], None] = print) -> Plan:
    common = {"version": INGEST_VERSION, "schema_version": SCHEMA_VERSION, "tokenizer_sha256": tokenizer_sha256}
    fingerprints: dict[Path, dict] = {}

    def fp(p: Path) -> dict:
        if p not in fingerprints:
            fingerprints[p] = file_fingerprint(p)
        return fingerprints[p]

    entity_files = _entity_files(cfg)
    entity_tasks = []
    for f_idx, (reader, path, world) in enumerate(entity_files):
        source = fp(path)  # an empty file has no chunk but is still a source
        for c_idx, (a, b) in enumerate(plan_byte_ranges(path, cfg.chunk_bytes)):
            spec = {**common, "reader": reader, "source": source, "bytes": [a, b], "world": world,
                    "max_len": cfg.entity_max_len, "strip_title": cfg.zeshel_strip_title}
            entity_tasks.append(ChunkTask(f"entities-{f_idx:03d}-{c_idx:06d}", "entities", reader, str(path),
                                          a, b, world, b - a, spec))
    mention_tasks = []
    for split, reader, path, deps in _mention_sources(cfg, log):
        spec = {**common, "reader": reader, "split": split, "sources": [fp(p) for p in deps],
                "max_len": cfg.mention_max_len}
        # A Zeshel split is read through its tree (context documents); AIDA through its file.
        root = str(Path(cfg.zeshel_root).resolve()) if reader == "zeshel_mentions" else str(path)
        task = ChunkTask(f"mentions-{split}", "mentions", reader, root, 0, -1, split, path.stat().st_size, spec)
        mention_tasks.append((split, task, path))
    return Plan(entity_files, entity_tasks, mention_tasks, list(fingerprints.values()))


# --------------------------------------------------------------------------- orchestration


def _skipped(chunks: list[Chunk], assembly_bad: BadRecordLog) -> dict:
    """All skipped records with global line numbers (capped list, exact count)."""
    records, count = [], 0
    for c in chunks:
        res = c.marker["result"]
        count += res["skipped_count"]
        for s in res["skipped"]:
            local = c.task.end >= 0 and s["path"] == c.task.path
            records.append({**s, "line": s["line"] + (c.line_base if local else 0)})
    records += assembly_bad.skipped
    count += assembly_bad.count
    # A malformed Zeshel document line is met by its entity chunk and again by the
    # mention split that loads it as context: list and count it once.
    unique = {(r["path"], r["line"], r["reason"]): r for r in records}
    count -= len(records) - len(unique)
    records = sorted(unique.values(), key=lambda s: (s["path"], s["line"]))
    return {"count": count, "listed": min(len(records), SKIPPED_LIST_CAP), "records": records[:SKIPPED_LIST_CAP]}


def _zeshel_selection(cfg: PrepareConfig) -> dict:
    """The world/split selection, only when one is made (so stores prepared before these
    options existed keep their spec)."""
    out = {}
    if cfg.zeshel_worlds is not None:
        out["zeshel_worlds"] = cfg.zeshel_world_list
    if cfg.zeshel_splits is not None:
        out["zeshel_splits"] = cfg.zeshel_split_list
    return out


def _spec(cfg: PrepareConfig, fingerprints: list, tokenizer_fp: dict) -> dict:
    """Everything the store's content depends on (not how it was computed)."""
    return {"sources": fingerprints, "tokenizer_sha256": tokenizer_fp["sha256"],
            "entity_max_len": cfg.entity_max_len, "mention_max_len": cfg.mention_max_len,
            "zeshel_strip_title": cfg.zeshel_strip_title, "on_bad_record": cfg.on_bad_record,
            "version": INGEST_VERSION, **_zeshel_selection(cfg)}


NOTHING_TO_DO = "nothing to do"


def _content_identity(spec: dict) -> dict:
    """``spec`` without where the sources lie: a store and its sources moved together (to
    shared storage, say) are still the same store."""
    return {**spec, "sources": [{k: v for k, v in f.items() if k != "path"} for f in spec.get("sources") or []]}


def _existing(out: Path, spec: dict) -> tuple[dict | None, list[str]]:
    """(its manifest, []) if ``out`` already holds this store; (None, what differs) if it
    holds another; (None, []) if it holds none."""
    path = out / MANIFEST
    if not path.exists():
        return None, []
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, ["manifest.json (unreadable)"]
    old_spec = old.get("spec") or {}
    if old.get("kind") != KIND or old.get("schema_version") != SCHEMA_VERSION:
        return None, ["kind/schema_version"]
    have, want = _content_identity(old_spec), _content_identity(spec)
    if have == want:
        return old, []
    return None, [k for k in want if have.get(k) != want[k]] or ["spec"]


def prepare(cfg: PrepareConfig, log: Callable[[str], None] = print) -> dict:
    """Build (or resume building) the store described by ``cfg``; return its manifest."""
    from dist_nce.core.text import tokenizer_fingerprint

    try:
        cfg.validate()
    except ValueError as e:
        raise PrepareError(str(e)) from None
    out = Path(cfg.out)
    recover(out, log)
    tok_fp = tokenizer_fingerprint(tokenizer(cfg.model_dir))
    todo = plan(cfg, tok_fp["sha256"], log)
    spec = _spec(cfg, todo.fingerprints, tok_fp)
    existing, differs = _existing(out, spec)
    if existing is not None:
        log(f"{out}: already prepared from these inputs; {NOTHING_TO_DO}")
        return existing
    if not differs:
        return _build(cfg, out, todo, spec, tok_fp, log)
    if not cfg.overwrite:
        raise PrepareError(_other_inputs(out, differs))
    new = staging_dir(out)
    log(f"{out}: prepared from other inputs (differs in: {', '.join(differs)}); building its replacement in {new} "
        "(the old store stays in place until the new one is complete)")
    staged, _ = _existing(new, spec)
    if staged is None:
        # Another replacement's manifest: its chunks are still reused where they match.
        (new / MANIFEST).unlink(missing_ok=True)
        staged = _build(cfg, new, todo, spec, tok_fp, log)
    swap_in(new, out)
    log(f"{out}: replaced by the new store")
    return staged


def _other_inputs(out: Path, differs: list[str]) -> str:
    return (f"{out} already holds a prepared store from other inputs (differs in: {', '.join(differs)}); replace "
            "it (kb.prepare --overwrite) or prepare into another directory")


def conflict(cfg: PrepareConfig, regenerate_from: str | os.PathLike | None = None) -> str | None:
    """What :func:`ensure_store` would refuse at once, without preparing anything: ``cfg.out`` holding a store
    prepared from other inputs or settings (a ``--dry-run``'s check; the run checks it again). None when
    there is no store yet, the same one, or one it would replace (``overwrite``, or derived from
    ``regenerate_from``). Reads the inputs' fingerprints and the store's manifest; writes nothing."""
    from dist_nce.core.text import tokenizer_fingerprint

    out = Path(cfg.out)
    if cfg.overwrite or not (out / MANIFEST).exists():
        return None
    if regenerate_from is not None and derived_from(out, regenerate_from):
        return None
    try:
        cfg.validate()
    except ValueError as e:
        return str(e)
    tok_fp = tokenizer_fingerprint(tokenizer(cfg.model_dir))
    spec = _spec(cfg, plan(cfg, tok_fp["sha256"], log=lambda s: None).fingerprints, tok_fp)
    existing, differs = _existing(out, spec)
    return None if existing is not None or not differs else _other_inputs(out, differs)


def _build(cfg: PrepareConfig, dest: Path, todo: Plan, spec: dict, tok_fp: dict,
           log: Callable[[str], None]) -> dict:
    """Ingest every chunk into ``dest/chunks``, check, assemble, then write the manifest."""
    work = dest / WORK_DIR
    run_id = uuid.uuid4().hex[:12]
    settings = EncodeSettings(cfg.model_dir, cfg.entity_max_len, cfg.mention_max_len, cfg.zeshel_strip_title,
                              cfg.on_bad_record)
    entity_tasks = todo.entity_tasks
    tasks = entity_tasks + [t for _, t, _ in todo.mention_tasks]
    log(f"prepare: {len(entity_tasks)} entity chunks, {len(todo.mention_tasks)} mention splits, "
        f"{cfg.workers} worker(s) -> {dest}")
    t0 = time.perf_counter()
    fn = functools.partial(process_chunk, work_dir=str(work), settings=settings, run_id=run_id)
    markers = run_chunks(tasks, work, fn, workers=cfg.workers, policy=cfg.on_bad_record,
                         progress=cfg.progress, log=log)
    t_chunks = time.perf_counter() - t0

    # Before assembly, so that an empty input writes nothing (its chunks stay for a rerun).
    entity_rows = {str(path): 0 for _, path, _ in todo.entity_files}
    for task, marker in zip(entity_tasks, markers):
        entity_rows[task.path] += marker["result"]["rows"]
    mention_rows = [(split, str(path), marker["result"]["rows"])
                    for (split, _, path), marker in zip(todo.mention_tasks, markers[len(entity_tasks):])]
    try:
        warnings = check_not_empty(entity_rows.items(), mention_rows, cfg.allow_empty, log)
    except EmptyInput as e:
        raise PrepareError(str(e)) from None

    chunks = load_chunks(work, tasks, markers)
    entity_chunks, mention_chunks = chunks[:len(entity_tasks)], chunks[len(entity_tasks):]
    assembly_bad = BadRecordLog(cfg.on_bad_record)
    entities = assemble_entities(dest, entity_chunks, cfg.entity_max_len, cfg.rows_per_part, assembly_bad)
    fields = {
        "source": {"format": todo.entity_files[0][0],
                   "entity_files": [str(p) for _, p, _ in todo.entity_files],
                   "aida_dir": str(Path(cfg.aida_dir).resolve()) if cfg.aida_dir else None,
                   "zeshel_root": str(Path(cfg.zeshel_root).resolve()) if cfg.zeshel_root else None,
                   "files": todo.fingerprints, **_zeshel_selection(cfg)},
        "tokenizer": tok_fp, "tokenizer_sha256": tok_fp["sha256"],
        "entity_max_len": cfg.entity_max_len, "mention_max_len": cfg.mention_max_len,
        "zeshel_strip_title": cfg.zeshel_strip_title,
        "entities": entities,
    }
    store = EntityStore.from_manifest(dest, fields)
    shutil.rmtree(dest / MENTIONS_DIR, ignore_errors=True)  # splits of an earlier attempt
    mentions = {}
    for (split, _, path), chunk in zip(todo.mention_tasks, mention_chunks):
        section = assemble_mentions(dest, split, chunk, store, cfg.mention_max_len, assembly_bad)
        section["source"] = str(path)
        section["gold_resolution"] = gold_resolution(section["gold"], cfg.min_gold_resolution)
        for warning in (resolution_warning(split, str(path), section["gold_resolution"]),
                        ambiguity_warning(split, str(path), section["ambiguous_title"])):
            if warning:
                log(f"WARNING: {warning}")
                warnings.append(warning)
        mentions[split] = section
    fields["mentions"] = mentions
    fields["skipped"] = _skipped(chunks, assembly_bad)
    fields["warnings"] = warnings
    reused = sum(m["run"] != run_id for m in markers)
    fields["ingest"] = {"run": run_id, "chunks": len(tasks), "reused_chunks": reused, "workers": cfg.workers,
                        "chunk_bytes": cfg.chunk_bytes, "on_bad_record": cfg.on_bad_record,
                        "chunk_seconds": round(t_chunks, 2),
                        "seconds": round(time.perf_counter() - t0, 2),
                        "chunk_runs": {m["task"]: m["run"] for m in markers}}
    fields["spec"] = spec
    manifest = write_manifest(dest, KIND, SCHEMA_VERSION, **fields)
    if not cfg.keep_chunks:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def ensure_store(cfg: PrepareConfig, log: Callable[[str], None] = print,
                 regenerate_from: str | os.PathLike | None = None) -> bool:
    """:func:`prepare` for jobs, which call it on every run: silent when ``cfg.out`` already
    holds this store, logging (and summarizing) when it builds; True if it built.

    regenerate_from: a directory of derived sources (synthetic data); a store prepared
      from files under it that have changed since is prepared again instead of refused.
    """
    out = Path(cfg.out)
    recover(out, log)
    before = (out / MANIFEST).read_bytes() if (out / MANIFEST).exists() else None
    if regenerate_from is not None and derived_from(out, regenerate_from):
        cfg = dataclasses.replace(cfg, overwrite=True)
    prepare(cfg, log=lambda msg: None if msg.endswith(NOTHING_TO_DO) else log(msg))
    changed = before != (out / MANIFEST).read_bytes()
    if changed:
        log(summarize(out))
    return changed


def derived_from(out: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """True if ``out`` holds a store prepared only from files under ``directory`` (a
    synthetic data directory, say, whose regeneration makes the store stale)."""
    path = Path(out) / MANIFEST
    if not path.exists():
        return False
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["spec"]["sources"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
    root = Path(directory).resolve()
    return bool(files) and all(Path(f["path"]).resolve().is_relative_to(root) for f in files)


# --------------------------------------------------------------------------- CLI


# Input paths a typo in which is refused as the flag's, before anything is read (after parsing: the
# flags also parse where the files are not).
SOURCES = {"--kilt-ks": "file", "--blink-entities": "file", "--aida-dir": "dir", "--zeshel-root": "dir"}


def build_parser() -> argparse.ArgumentParser:
    """argparse flags generated from :class:`PrepareConfig` (one source of truth for help)."""
    parser = FlagParser(prog="prepare_kb", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = {"int": int, int: int, "float": float, float: float}
    for f in dataclasses.fields(PrepareConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            if f.default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=help_)
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", help=help_)
        elif f.name == "on_bad_record":
            parser.add_argument(flag, dest=f.name, choices=["error", "skip"], default=f.default, help=help_)
        else:
            shown = f" (default: {f.default})" if f.default not in (None, "") else ""
            kind = kinds.get(f.type)
            # The field's own range, so that a bad value stops here, before any input is read.
            parse = (number(kind, f.metadata.get("range")) if kind else CHUNK_SIZE if f.name == "chunk_size"
                     else str)
            parser.add_argument(flag, dest=f.name, type=parse, default=f.default,
                                required=f.name == "out", help=help_ + shown)
    return parser


def _chunk_size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError:  # its message names the config key; the flag's reads "--chunk-size: 12Q: ..."
        raise ValueError("expected a positive byte count like 33554432 or 32M (suffix K, M or G)") from None
    return text


CHUNK_SIZE = checked(_chunk_size, "size")


def input_error(e: Exception) -> int | None:
    """The exit code and message for an ingest error a user can fix (2), None for any other.

    Shared by the ingest commands (prepare, kb.delta): a bad record gets the skip hint."""
    if isinstance(e, BadRecord):
        print(f"error: {e}\n  (pass --on-bad-record skip to skip malformed lines and list them in the manifest)",
              file=sys.stderr)
        return 2
    if isinstance(e, (PrepareError, ArtifactMismatch, FileNotFoundError)):
        print(f"error: {e}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = missing_input(args, SOURCES)
    if code is not None:
        return code
    try:
        cfg = PrepareConfig(**vars(args))
        prepare(cfg, log=lambda s: print(s, file=sys.stderr))
    except (BadRecord, PrepareError, ArtifactMismatch, FileNotFoundError) as e:
        return input_error(e)
    except KeyboardInterrupt:
        print(f"interrupted: completed chunks are kept in {Path(args.out) / WORK_DIR} (or, when replacing a store, "
              f"in {staging_dir(args.out) / WORK_DIR}); run the same command again to resume", file=sys.stderr)
        return 130
    print(summarize(cfg.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
