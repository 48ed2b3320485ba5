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
manifest is always complete.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from dist_nce.artifacts import MANIFEST, ArtifactMismatch, write_manifest
from kb.assemble import Chunk, assemble_entities, assemble_mentions, load_chunks
from kb.chunk_worker import SKIPPED_LIST_CAP, EncodeSettings, process_chunk, tokenizer
from kb.ingest import ChunkTask, file_fingerprint, plan_byte_ranges, run_chunks
from kb.records import BadRecord, BadRecordLog
from kb.store import KIND, MENTIONS_DIR, SCHEMA_VERSION, EntityStore, open_manifest

# Bump when chunk contents change meaning, so old chunks are not reused.
INGEST_VERSION = 1
WORK_DIR = "chunks"
AIDA_FILES = {"train": "aidayago2-train-kilt.jsonl", "dev": "aidayago2-dev-kilt.jsonl",
              "test": "aidayago2-test_without_answers-kilt.jsonl"}


class PrepareError(ValueError):
    """Invalid prepare request (bad combination of sources, existing output, ...)."""


def _h(text: str) -> dict:
    return {"help": text}


@dataclass
class PrepareConfig:
    out: str = field(default="", metadata=_h("output directory of the prepared store"))
    kilt_ks: str | None = field(default=None, metadata=_h("kilt_knowledgesource.json (entities)"))
    aida_dir: str | None = field(default=None, metadata=_h(
        "directory with aidayago2-{train,dev,test_without_answers}-kilt.jsonl (mentions; with --kilt-ks "
        "or --blink-entities)"))
    zeshel_root: str | None = field(default=None, metadata=_h("Zeshel root with documents/ and mentions/"))
    blink_entities: str | None = field(default=None, metadata=_h("BLINK entity.jsonl (entities)"))
    model_dir: str | None = field(default=None, metadata=_h("tokenizer directory (default: shipped MiniLM)"))
    mention_max_len: int = field(default=32, metadata=_h("mention tokens (32 in BLINK, 128 in the paper)"))
    entity_max_len: int = field(default=128, metadata=_h("entity tokens"))
    zeshel_strip_title: bool = field(default=False, metadata=_h(
        "drop the title that starts every Zeshel document from the description"))
    zeshel_worlds: str | None = field(default=None, metadata=_h(
        "comma-separated Zeshel worlds whose documents become the entities (a split name train/val/test "
        "stands for its worlds); default: every documents/<world>.json. Mentions whose gold is in another "
        "world are kept and counted as missing gold"))
    zeshel_splits: str | None = field(default=None, metadata=_h(
        "comma-separated Zeshel mention splits to read (default: train, val, test and the heldout splits "
        "present)"))
    workers: int = field(default=1, metadata=_h("parallel worker processes"))
    chunk_size: str = field(default="32M", metadata=_h("bytes of input per chunk (suffix K/M/G allowed)"))
    rows_per_part: int = field(default=1 << 18, metadata=_h("entity rows per Arrow part file"))
    on_bad_record: Literal["error", "skip"] = field(default="error", metadata=_h(
        "error: stop at the first malformed line; skip: count, report and record them"))
    overwrite: bool = field(default=False, metadata=_h("replace an existing store prepared from other inputs"))
    keep_chunks: bool = field(default=False, metadata=_h("keep the per-chunk files after assembly"))
    progress: bool = field(default=True, metadata=_h("progress bar on stderr (--no-progress hides it)"))

    def validate(self) -> None:
        if not self.out:
            raise ValueError("out: an output directory is required")
        kb_sources = [n for n in ("kilt_ks", "zeshel_root", "blink_entities") if getattr(self, n)]
        if len(kb_sources) != 1:
            raise ValueError("give exactly one of --kilt-ks, --zeshel-root, --blink-entities "
                             f"(got {len(kb_sources)})")
        if self.aida_dir and self.zeshel_root:
            raise ValueError("--aida-dir goes with --kilt-ks or --blink-entities, not --zeshel-root")
        for name in ("zeshel_strip_title", "zeshel_worlds", "zeshel_splits"):
            if getattr(self, name) and not self.zeshel_root:
                raise ValueError(f"--{name.replace('_', '-')} applies to --zeshel-root only")
        self.zeshel_world_list, self.zeshel_split_list  # noqa: B018 - validates the names
        for name in ("mention_max_len", "entity_max_len", "workers", "rows_per_part"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.chunk_bytes  # noqa: B018 - validates the size string

    @property
    def chunk_bytes(self) -> int:
        return parse_size(self.chunk_size)

    @property
    def zeshel_world_list(self) -> list[str] | None:
        """The selected worlds (split names expanded, order kept, no repeats), or None for all."""
        from kb.zeshel import ZESHEL_WORLDS

        if self.zeshel_worlds is None:
            return None
        worlds: list[str] = []
        for item in _items(self.zeshel_worlds, "zeshel_worlds"):
            for w in ZESHEL_WORLDS.get(item, [item]):
                if w not in worlds:
                    worlds.append(w)
        return worlds

    @property
    def zeshel_split_list(self) -> list[str] | None:
        from kb.zeshel import ZESHEL_SPLITS

        if self.zeshel_splits is None:
            return None
        splits = list(dict.fromkeys(_items(self.zeshel_splits, "zeshel_splits")))
        unknown = [s for s in splits if s not in ZESHEL_SPLITS]
        if unknown:
            raise ValueError(f"zeshel_splits: unknown split(s) {unknown}; expected some of {list(ZESHEL_SPLITS)}")
        return splits


def _items(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: expected a comma-separated list, got {text!r}")
    return items


def parse_size(text: str | int) -> int:
    """``"32M"`` -> 33554432; plain integers are bytes."""
    s = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        value = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"chunk_size: expected bytes like 33554432 or 32M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"chunk_size must be positive, got {text!r}")
    return value


# --------------------------------------------------------------------------- planning


def _require_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: {what} not found")
    return p


def _entity_files(cfg: PrepareConfig) -> list[tuple[str, Path, str | None]]:
    """(reader, file, world) for every entity file, in row order."""
    if cfg.kilt_ks:
        return [("kilt", _require_file(cfg.kilt_ks, "KILT knowledge source"), None)]
    if cfg.blink_entities:
        return [("blink", _require_file(cfg.blink_entities, "BLINK entity.jsonl"), None)]
    from kb.zeshel import document_paths

    worlds = cfg.zeshel_world_list
    if worlds is not None:
        # A split name stands for those of its worlds that have documents (a tree may hold a
        # subset, as synthetic ones do); a world named explicitly must have them.
        named = set(_items(cfg.zeshel_worlds, "zeshel_worlds"))
        doc_dir = Path(cfg.zeshel_root) / "documents"
        worlds = [w for w in worlds if w in named or (doc_dir / f"{w}.json").is_file()]
        if not worlds:
            raise FileNotFoundError(f"{doc_dir}: no document file for any world of {cfg.zeshel_worlds!r}")
    return [("zeshel", p, p.stem) for p in document_paths(cfg.zeshel_root, worlds)]


def _mention_sources(cfg: PrepareConfig) -> list[tuple[str, str, Path, list[Path]]]:
    """(split, reader, file, files its content depends on) per mention split."""
    if cfg.aida_dir:
        d = Path(cfg.aida_dir)
        found = [(s, d / f) for s, f in AIDA_FILES.items() if (d / f).is_file()]
        if not found:
            raise FileNotFoundError(f"{d}: none of {sorted(AIDA_FILES.values())} found")
        return [(s, "aida", p, [p]) for s, p in found]
    if cfg.zeshel_root:
        from kb.zeshel import ZESHEL_SPLITS, document_paths

        root = Path(cfg.zeshel_root)
        chosen = cfg.zeshel_split_list
        splits = [s for s in chosen or ZESHEL_SPLITS if (root / "mentions" / f"{s}.json").is_file()]
        missing = [s for s in chosen or ("train", "val", "test") if s not in splits]
        if missing:
            raise FileNotFoundError(f"{root / 'mentions'}: missing {', '.join(s + '.json' for s in missing)}")
        docs = document_paths(root)
        return [(s, "zeshel_mentions", root / "mentions" / f"{s}.json", [root / "mentions" / f"{s}.json", *docs])
                for s in splits]
    return []


def plan(cfg: PrepareConfig, tokenizer_sha256: str) -> tuple[list[ChunkTask], list[tuple[str, ChunkTask]], list]:
    """(entity chunk tasks in row order, (split, mention task) pairs, source fingerprints)."""
    common = {"version": INGEST_VERSION, "schema_version": SCHEMA_VERSION, "tokenizer_sha256": tokenizer_sha256}
    fingerprints: dict[Path, dict] = {}

    def fp(p: Path) -> dict:
        if p not in fingerprints:
            fingerprints[p] = file_fingerprint(p)
        return fingerprints[p]

    entity_tasks = []
    for f_idx, (reader, path, world) in enumerate(_entity_files(cfg)):
        for c_idx, (a, b) in enumerate(plan_byte_ranges(path, cfg.chunk_bytes)):
            spec = {**common, "reader": reader, "source": fp(path), "bytes": [a, b], "world": world,
                    "max_len": cfg.entity_max_len, "strip_title": cfg.zeshel_strip_title}
            entity_tasks.append(ChunkTask(f"entities-{f_idx:03d}-{c_idx:06d}", "entities", reader, str(path),
                                          a, b, world, b - a, spec))
    mention_tasks = []
    for split, reader, path, deps in _mention_sources(cfg):
        spec = {**common, "reader": reader, "split": split, "sources": [fp(p) for p in deps],
                "max_len": cfg.mention_max_len}
        root = cfg.zeshel_root if reader == "zeshel_mentions" else str(path)
        mention_tasks.append((split, ChunkTask(f"mentions-{split}", "mentions", reader, str(root), 0, -1, split,
                                               path.stat().st_size, spec)))
    return entity_tasks, mention_tasks, list(fingerprints.values())


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


def _check_existing(out: Path, spec: dict, overwrite: bool, log: Callable[[str], None]) -> dict | None:
    """The existing manifest if ``out`` is already this store; raise if it is another
    (or, with ``overwrite``, make way for preparing it again)."""
    path = out / MANIFEST
    if not path.exists():
        return None
    old = json.loads(path.read_text(encoding="utf-8"))
    old_spec = old.get("spec") or {}
    same_kind = old.get("kind") == KIND and old.get("schema_version") == SCHEMA_VERSION
    if same_kind and _content_identity(old_spec) == _content_identity(spec):
        return old
    differs = ([k for k in spec if _content_identity(old_spec).get(k) != _content_identity(spec)[k]]
               if same_kind else ["kind/schema_version"])
    if not overwrite:
        raise PrepareError(f"{out} already holds a prepared store from other inputs (differs in: "
                           f"{', '.join(differs)}); replace it (kb.prepare --overwrite) or prepare into "
                           "another directory")
    log(f"{out}: prepared from other inputs (differs in: {', '.join(differs)}); preparing it again")
    path.unlink()  # the store is incomplete from here until the new manifest is written
    return None


def ensure_store(cfg: PrepareConfig, log: Callable[[str], None] = print,
                 regenerate_from: str | os.PathLike | None = None) -> bool:
    """:func:`prepare` for jobs, which call it on every run: silent when ``cfg.out`` already
    holds this store, logging (and summarizing) when it builds; True if it built.

    regenerate_from: a directory of derived sources (synthetic data); a store prepared
      from files under it that have changed since is prepared again instead of refused.
    """
    out = Path(cfg.out)
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


def prepare(cfg: PrepareConfig, log: Callable[[str], None] = print) -> dict:
    """Build (or resume building) the store described by ``cfg``; return its manifest."""
    from dist_nce.text import tokenizer_fingerprint

    try:
        cfg.validate()
    except ValueError as e:
        raise PrepareError(str(e)) from None
    out = Path(cfg.out)
    tok = tokenizer(cfg.model_dir)
    tok_fp = tokenizer_fingerprint(tok)
    entity_tasks, mention_tasks, fingerprints = plan(cfg, tok_fp["sha256"])
    spec = _spec(cfg, fingerprints, tok_fp)
    existing = _check_existing(out, spec, cfg.overwrite, log)
    if existing is not None:
        log(f"{out}: already prepared from these inputs; {NOTHING_TO_DO}")
        return existing

    work = out / WORK_DIR
    run_id = uuid.uuid4().hex[:12]
    settings = EncodeSettings(cfg.model_dir, cfg.entity_max_len, cfg.mention_max_len, cfg.zeshel_strip_title,
                              cfg.on_bad_record)
    tasks = entity_tasks + [t for _, t in mention_tasks]
    log(f"prepare: {len(entity_tasks)} entity chunks, {len(mention_tasks)} mention splits, "
        f"{cfg.workers} worker(s) -> {out}")
    t0 = time.perf_counter()
    fn = functools.partial(process_chunk, work_dir=str(work), settings=settings, run_id=run_id)
    markers = run_chunks(tasks, work, fn, workers=cfg.workers, policy=cfg.on_bad_record,
                         progress=cfg.progress, log=log)
    t_chunks = time.perf_counter() - t0

    chunks = load_chunks(work, tasks, markers)
    entity_chunks, mention_chunks = chunks[:len(entity_tasks)], chunks[len(entity_tasks):]
    assembly_bad = BadRecordLog(cfg.on_bad_record)
    entities = assemble_entities(out, entity_chunks, cfg.entity_max_len, cfg.rows_per_part, assembly_bad)
    fields = {
        "source": {"format": entity_tasks[0].reader if entity_tasks else "none",
                   "entity_files": [str(p) for _, p, _ in _entity_files(cfg)],
                   "aida_dir": cfg.aida_dir, "zeshel_root": cfg.zeshel_root, "files": fingerprints,
                   **_zeshel_selection(cfg)},
        "tokenizer": tok_fp, "tokenizer_sha256": tok_fp["sha256"],
        "entity_max_len": cfg.entity_max_len, "mention_max_len": cfg.mention_max_len,
        "zeshel_strip_title": cfg.zeshel_strip_title,
        "entities": entities,
    }
    store = EntityStore.from_manifest(out, fields)
    shutil.rmtree(out / MENTIONS_DIR, ignore_errors=True)  # splits of an overwritten store
    fields["mentions"] = {split: assemble_mentions(out, split, c, store, cfg.mention_max_len)
                          for (split, _), c in zip(mention_tasks, mention_chunks)}
    fields["skipped"] = _skipped(chunks, assembly_bad)
    reused = sum(m["run"] != run_id for m in markers)
    fields["ingest"] = {"run": run_id, "chunks": len(tasks), "reused_chunks": reused, "workers": cfg.workers,
                        "chunk_bytes": cfg.chunk_bytes, "on_bad_record": cfg.on_bad_record,
                        "chunk_seconds": round(t_chunks, 2),
                        "seconds": round(time.perf_counter() - t0, 2),
                        "chunk_runs": {m["task"]: m["run"] for m in markers}}
    fields["spec"] = spec
    manifest = write_manifest(out, KIND, SCHEMA_VERSION, **fields)
    if not cfg.keep_chunks:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


# --------------------------------------------------------------------------- summary and CLI


def summarize(store_dir: str | os.PathLike) -> str:
    """A human summary of a prepared store (what the job prints at the end)."""
    m = open_manifest(store_dir)
    ent = m["entities"]
    ts = ent["token_stats"]
    lines = [f"prepared KB: {Path(store_dir).resolve()}",
             f"  source: {m['source']['format']} ({', '.join(m['source']['entity_files'])})",
             f"  tokenizer: {m['tokenizer']['name']} (sha256 {m['tokenizer_sha256'][:12]}), "
             f"entity max {m['entity_max_len']}, mention max {m['mention_max_len']}",
             f"  entities: {ent['count']:,} in {len(ent['parts'])} part(s); tokens mean {ts['mean']}, "
             f"max {ts['max']}, {100 * ts['truncated_fraction']:.1f}% truncated at {m['entity_max_len']}"]
    if ent.get("worlds"):
        lines.append(f"  worlds: {len(ent['worlds'])} (" + ", ".join(
            f"{w} {b - a:,}" for w, (a, b) in ent["worlds"].items()) + ")")
    for split, info in m.get("mentions", {}).items():
        g = info["gold"]
        lines.append(f"  mentions {split}: {info['count']:,}; gold by id {g['id']:,}, by title {g['title']:,}, "
                     f"missing {g['missing']:,}, unlabelled {g['unlabelled']:,}; tokens mean "
                     f"{info['token_stats']['mean']}, {100 * info['token_stats']['truncated_fraction']:.1f}% "
                     f"truncated")
        if g["missing"]:
            ids = info["missing_gold"]["mention_ids"]
            lines.append(f"    missing gold (mention ids, see manifest): {', '.join(ids[:5])}"
                         + (" ..." if len(ids) > 5 else ""))
    sk = m["skipped"]
    lines.append(f"  skipped records: {sk['count']:,}")
    lines += [f"    {r['path']}:{r['line']}: {r['reason']}" for r in sk["records"][:10]]
    if sk["count"] > 10:
        lines.append(f"    ... {sk['count'] - 10:,} more (first {sk['listed']} in manifest.json)")
    ing = m.get("ingest", {})
    if ing:
        lines.append(f"  ingest: {ing['chunks']} chunks ({ing['reused_chunks']} reused), {ing['workers']} "
                     f"worker(s), {ing['seconds']} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """argparse flags generated from :class:`PrepareConfig` (one source of truth for help)."""
    parser = argparse.ArgumentParser(prog="prepare_kb", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
            kind = int if f.type in ("int", int) else str
            shown = f" (default: {f.default})" if f.default not in (None, "") else ""
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default,
                                required=f.name == "out", help=help_ + shown)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = PrepareConfig(**vars(args))
        prepare(cfg, log=lambda s: print(s, file=sys.stderr))
    except BadRecord as e:
        print(f"error: {e}\n  (pass --on-bad-record skip to skip malformed lines and list them in the manifest)",
              file=sys.stderr)
        return 2
    except (PrepareError, ArtifactMismatch, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: completed chunks are kept in {Path(args.out) / WORK_DIR}; run the same command "
              "again to resume", file=sys.stderr)
        return 130
    print(summarize(cfg.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
