"""Import precomputed entity encodings (BLINK's ``all_entities_large.t7``, a ``.npy``) as index version 0.

BLINK's released encodings with its biencoder, over a KB prepared from its ``entity.jsonl``::

    .venv/bin/python jobs/import_encodings.py --encodings models/all_entities_large.t7 \\
        --model models/biencoder_wiki_large.bin --prepared data/blink_kb \\
        --ids models/entity.jsonl --num-shards 8 --out data/blink_encodings

then link and evaluate with no encoding (the shards reuse what was imported)::

    .venv/bin/python jobs/evaluate_kilt_aida.py --model models/biencoder_wiki_large.bin \\
        --store data/blink_kb --out runs/blink_eval \\
        --snapshot-dir data/blink_encodings/shards --set num_shards=8

and a training run starts from it as its version 0 when the import is made for its config,
which then supplies the model (``model.blink_checkpoint``, ``model.init_from`` or the seeded
build: the same weights and architecture the run's ``build_retriever`` makes), the store
(``data.prepared_dir``), the shard layout (``service.num_shards``, the block sampler's row
grid), the storage dtype and the directory (``service.shard_dir``, default
``<run.output_dir>/shards``)::

    .venv/bin/python jobs/import_encodings.py --encodings models/all_entities_large.t7 \
        --ids models/entity.jsonl --train-config configs/aida/paper_dual_p0.yaml

The matrix is never loaded (``dist_nce.index.import_encodings``): rows are read a chunk at
a time and written to each shard's version as its storage dtype (``--storage-dtype``,
default the model's: BLINK's float32 becomes float16, half the disk and memory the shards
serve from). The rows are the store's rows in order, or, with ``--ids`` (BLINK's
``entity.jsonl``, or one id per line), matched by id. A rerun keeps the shards already
written: an interrupted import resumes by shard.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from dist_nce.cli.common import error, take
from dist_nce.core.config import AT_LEAST_1
from dist_nce.core.flags import FlagParser, existing, number

KIND = "imported_encodings"
SCHEMA_VERSION = 1
POSITIVE_INT = number(int, AT_LEAST_1)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="import_encodings", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encodings", required=True, type=existing("file"),
                   help="the matrix: a torch.save'd [entities, d] tensor (.t7/.pt, zip or legacy format) or a .npy")
    p.add_argument("--train-config", default=None, type=existing("file", "config file"),
                   help="a training config (configs/aida/*.yaml): import as that run's version 0; it supplies "
                        "--model, --prepared, --out, --num-shards, --row-grid and --storage-dtype")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--train-config override")
    p.add_argument("--model", default=None, type=existing("any"),
                   help="the model the encodings came from: a BLINK biencoder .bin or a "
                        "dist-nce retriever directory (its entity encoder is fingerprinted)")
    p.add_argument("--tokenizer", default=None, type=existing("dir"),
                   help="tokenizer directory for a BLINK .bin (default: the project's "
                        "default model, bert-uncased vocabulary)")
    p.add_argument("--prepared", default=None, type=existing("dir"),
                   help="prepared KB the rows belong to (jobs/prepare_kb.py)")
    p.add_argument("--out", default=None, help="output directory: shards/ (what --snapshot-dir takes) and "
                                               "manifest.json; with --train-config, the run's shard directory")
    p.add_argument("--ids", default=None, type=existing("file"),
                   help="ids of the matrix's rows in order: BLINK's entity.jsonl (.jsonl) or "
                        "one id per line; default: row i is the store's row i")
    p.add_argument("--num-shards", type=POSITIVE_INT, default=None,
                   help="shards the serving service will run (default 2)")
    p.add_argument("--row-grid", type=POSITIVE_INT, default=None,
                   help="shard boundaries on this grid (default: the grid a service with the default index "
                        "config splits this KB on: block_rows 128 under index.sampler auto, 1 for a KB too small "
                        "for it; a service with another index config: its IndexConfig.row_grid)")
    p.add_argument("--storage-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype the shards keep (default: the model's storage_dtype)")
    p.add_argument("--chunk-rows", type=POSITIVE_INT, default=16384, help="rows read and converted at a time")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    from dist_nce.actors.service import even_ranges
    from dist_nce.core.artifacts import read_manifest, write_manifest
    from dist_nce.core.text import tokenizer_fingerprint
    from dist_nce.index.encode import store_fingerprint
    from dist_nce.index.import_encodings import ImportTarget, align_rows, import_matrix, read_row_ids
    from dist_nce.index.matrix_file import open_matrix
    from kb.store import EntityStore

    t0 = time.perf_counter()
    matrix = open_matrix(args.encodings)  # first: a wrong file fails before any model is read
    hold_target(args)  # before the model is read: a busy target is refused at once
    shard_root, model = resolve_target(args)
    config = model.config
    spec = config.spec()
    if spec.entity_side.count != 1:
        raise ValueError(f"{args.model}: preset {config.preset!r} keeps {spec.entity_side.count or 'several'} "
                         "vectors per entity; a matrix holds one")
    if matrix.dim != model.hidden_size:
        raise ValueError(f"{matrix.describe()}: d = {matrix.dim}, but {args.model} encodes d = {model.hidden_size}")
    if model.tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer; cannot check the prepared store")
    store = EntityStore(args.prepared, tokenizer_sha256=tokenizer_fingerprint(model.tokenizer)["sha256"])
    if store.kb_version:
        raise ValueError(f"{args.prepared} was changed by KB deltas (kb_version {store.kb_version}): compact it "
                         "first (jobs/update_kb.py --store ... --compact --out NEW) and import into NEW")
    fingerprint = model.encoder_fingerprint
    ids = read_row_ids(args.ids) if args.ids else None
    row_of = align_rows(matrix, store, ids, args.ids or "--ids")
    del ids
    storage_dtype = args.storage_dtype or config.storage_dtype
    n = store.num_entities
    if getattr(args, "index_config", None) is not None:  # the service's grid for this KB (IndexConfig.row_grid)
        args.row_grid = args.index_config.row_grid(n, args.num_shards)
    out = Path(args.out)
    target = ImportTarget(shard_root, even_ranges(n, args.num_shards, args.row_grid),
                          store_fingerprint(args.prepared), dataclasses.asdict(spec), storage_dtype, fingerprint)
    print(f"import_encodings: {matrix.describe()} -> {n:,} store rows ({'by id' if row_of is not None else 'in order'})"
          f" as {storage_dtype}, {args.num_shards} shards -> {target.shard_root}; encoder fingerprint "
          f"{fingerprint} ({'read off the file' if model.streamed else 'of the loaded model'})", file=sys.stderr)
    source = {"path": str(Path(args.encodings).resolve()), "format": matrix.format, "rows": matrix.rows,
              "dim": matrix.dim, "dtype": "bfloat16" if matrix.bfloat16 else str(matrix.dtype),
              "bytes": Path(args.encodings).stat().st_size, "ids": str(Path(args.ids).resolve()) if args.ids else None}
    with tqdm(total=n, unit="ent", desc="import", disable=not args.progress) as bar:
        shards = import_matrix(matrix, row_of, target, chunk_rows=args.chunk_rows, progress=bar.update,
                               encode_dtype="imported", imported_from=source)
    seconds = round(time.perf_counter() - t0, 2)
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    fields = dict(encodings=source, model=model, prepared=str(Path(args.prepared).resolve()),
                  store_fingerprint=target.store_fingerprint, encoder_fingerprint=fingerprint, preset=config.preset,
                  storage_dtype=storage_dtype, num_shards=args.num_shards, row_grid=args.row_grid,
                  shard_dir=str(shard_root.resolve()),
                  shards=[{"rows": m["rows"], "dir": str(p.relative_to(shard_root))}
                          for m, p in zip(shards, _version_dirs(target))],
                  num_entities=n, seconds=seconds)
    if (out / "manifest.json").is_file():  # a rerun: the same import, or refused
        read_manifest(out, KIND, SCHEMA_VERSION, expect={k: fields[k] for k in
                                                          ("encoder_fingerprint", "store_fingerprint", "num_shards")})
    manifest = write_manifest(out, KIND, SCHEMA_VERSION, **fields)
    print(f"import_encodings: {n:,} x {matrix.dim} -> {out} ({seconds} s); serve it with --snapshot-dir "
          f"{target.shard_root} and {args.num_shards} shards", file=sys.stderr)
    return manifest


def resolve_target(args: argparse.Namespace) -> tuple[Path, Any]:
    """(shard root, ``SourceModel`` of the model the encodings came from), filling ``args`` from
    ``--train-config``.

    With a training config the model is the run's own ``build_retriever(model, seed)``, so
    its entity encoder's fingerprint is the one the run's ``ensure_encoded`` looks for; explicit
    flags that contradict the config are refused rather than silently making a version the run
    would not use. A BLINK ``.bin`` is fingerprinted off the file, not loaded
    (``index.import_encodings.blink_source_model``)."""
    from dist_nce.index.import_encodings import blink_source_model, loaded_source_model
    from dist_nce.modeling.resolve import is_checkpoint_file, load_retriever
    from dist_nce.modeling.retriever import RetrieverConfig

    if args.train_config is None:
        args.num_shards = args.num_shards or 2
        if args.row_grid is None:  # the layout a service with the default index config will look for
            from dist_nce.index.config import IndexConfig

            args.index_config = IndexConfig()
        # load_retriever's defaults for a BLINK file: RetrieverConfig(), the tokenizer of --tokenizer
        model = blink_source_model(args.model, RetrieverConfig(), args.tokenizer) \
            if is_checkpoint_file(args.model) else None
        return Path(args.out) / "shards", model or loaded_source_model(
            load_retriever(args.model, tokenizer_dir=args.tokenizer))
    from dist_nce.core.config import load_config
    from dist_nce.train.config import TrainJobConfig, with_absolute_paths
    from dist_nce.train.model import build_retriever

    cfg = with_absolute_paths(load_config(TrainJobConfig, args.train_config, args.set))
    src = args.train_config
    given = {"--model": (args.model, cfg.model.blink_checkpoint or cfg.model.init_from),
             "--prepared": (args.prepared, cfg.data.prepared_dir),
             "--num-shards": (args.num_shards, cfg.service.num_shards),
             "--row-grid": (args.row_grid, cfg.service.index.row_grid()),
             "--storage-dtype": (args.storage_dtype, cfg.model.retriever.storage_dtype)}
    clash = [f"{flag} {mine} (the config: {theirs})" for flag, (mine, theirs) in given.items()
             if mine is not None and str(mine) != str(theirs)
             and not (flag in ("--model", "--prepared") and theirs and Path(mine).resolve() == Path(theirs).resolve())]
    if clash:
        raise ValueError(f"{src}: {'; '.join(clash)}: the run would not use such a version; drop the flags or "
                         "change the config (--set)")
    if not cfg.data.prepared_dir:
        raise ValueError(f"{src}: data.prepared_dir: not set; prepare the store first")
    args.model = args.model or cfg.model.blink_checkpoint or cfg.model.init_from or f"{src} (model.retriever)"
    args.prepared = cfg.data.prepared_dir
    args.num_shards, args.row_grid = cfg.service.num_shards, cfg.service.index.row_grid()
    args.index_config = cfg.service.index  # sampler auto: a KB too small for its grid is split evenly
    shard_root = Path(cfg.service.shard_dir or Path(cfg.run.output_dir) / "shards")
    args.out = args.out or str(shard_root)
    # build_retriever reads a BLINK file as load_blink_retriever(blink_checkpoint, retriever config)
    model = blink_source_model(cfg.model.blink_checkpoint, cfg.model.retriever) if cfg.model.blink_checkpoint else None
    return shard_root, model or loaded_source_model(build_retriever(cfg.model, cfg.optim.seed))


def hold_target(args: argparse.Namespace) -> None:
    """Lock what the import writes until :func:`main` returns (``dist_nce.core.run_lock``): with
    ``--train-config`` the run itself, by the lock its training job takes (an import into the shards of a
    run that trains would write the versions its shards read and persist), else ``--out``. Raises
    RunDirBusy naming the holder when another live job has it."""
    if args.train_config is not None:  # the run whose shards are written: locked as its own job locks it
        from dist_nce.core.config import load_config
        from dist_nce.train.config import TrainJobConfig, with_absolute_paths

        run = with_absolute_paths(load_config(TrainJobConfig, args.train_config, args.set)).run
        directory, what, instead = run.output_dir, f"run directory {run.output_dir}", "import for another run"
    else:
        directory, what, instead = args.out, f"--out {args.out}", "use another --out"
    try:
        args.held = take(directory, what, instead)  # released by main() or the process's end
    except OSError as e:  # the directory or the lock file cannot be made (permissions, a file in the way)
        raise ValueError(f"{what}: cannot take its lock: {e}") from e


def _version_dirs(target) -> list[Path]:
    from dist_nce.index.versions import shard_dir_name, version_dir_name

    return [target.shard_root / shard_dir_name(i, len(target.ranges)) / version_dir_name(0)
            for i in range(len(target.ranges))]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.train_config is None:  # before the matrix is opened: nothing read for a command that cannot run
        missing = [flag for flag, value in (("--model", args.model), ("--prepared", args.prepared),
                                            ("--out", args.out)) if value is None]
        if missing:
            return error(f"{', '.join(missing)}: required without --train-config")
    from dist_nce.core.artifacts import ArtifactMismatch
    from dist_nce.core.run_lock import RunDirBusy

    try:
        run(args)
    except (ValueError, ArtifactMismatch, FileNotFoundError, FileExistsError, RunDirBusy) as e:
        return error(e)
    finally:
        if getattr(args, "held", None) is not None:  # the lock run() took (hold_target), for a caller in-process
            args.held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
