"""Run a grid of Zeshel retrievers (architectures x negatives) and tabulate it like the paper's Table 1.

Every row of ``--rows`` is the base ``--config`` plus the row's overrides, trained and
evaluated by jobs/zeshel_retriever.py's code (``dist_nce.zeshel.run.run_retriever``) in
ONE Ray session, over ONE pair of prepared stores (the base config's), each row in
``<out>/<row>-<key>/``, where the key hashes the row's config and the stores' identities. A
row whose ``summary.json`` says it finished is not run again, so an interrupted grid
continues where it stopped; a row whose settings or data changed gets a new key, so a
stale result is never reused (its old directory is left as it was). A grid time-boxed with
``--set run.stop_after_steps=N`` lists the rows it stopped as unfinished (no recall, no
verdict) and continues them when run again with N raised or removed. The untrained model of
each architecture is evaluated too (``untrained``, kept in
``<out>/<architecture>_untrained-<key>/``), the reference point for what training did.

Writes ``<out>/grid.md`` (the table and whether hard / mixed negatives beat random for
each architecture), ``<out>/grid.json`` and ``<out>/grid.png`` (bar chart).

The mini-paper on this CPU (synthetic Zeshel, tiny model, dual / multi-8 / SOM x random /
hard / mixed-50)::

    .venv/bin/python jobs/zeshel_grid.py --config configs/zeshel/retriever_tiny_cpu.yaml \\
        --rows configs/zeshel/grid_tiny_rows.yaml --out runs/zeshel_grid_tiny

The paper's Table 1 on a GPU cluster (or --only som_hard,som_mixed50 for some rows)::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/zeshel_grid.py \\
        --config configs/zeshel/retriever_paper_gpu.yaml --rows configs/zeshel/table1_rows.yaml \\
        --out /mnt/shared/runs/zeshel_grid --set data.zeshel_root=/mnt/shared/zeshel \\
        --set data.prepared_dir=/mnt/shared/prepared/zeshel_train \\
        --set zeshel.eval_store=/mnt/shared/prepared/zeshel_eval \\
        --set model.retriever.mention_model=/mnt/shared/models/bert-base-uncased

Everything a later submission reads again on shared storage: ``--working-dir`` uploads the project without its
git-ignored ``data/`` and ``runs/``, so stores left under ``data/`` were prepared again by each submission, and a
store prepared again is other data to the row keys (its manifest's identity): every row started over.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from dist_nce.cli.common import dry_run_ok, error, hold, hold_run, interrupted, interrupted_preparing
from dist_nce.cli.zeshel_retriever import JOB as RETRIEVER
from dist_nce.core.config import ConfigError
from dist_nce.core.flags import FlagParser, existing, names
from dist_nce.core.run_lock import LOCK_FILE
from dist_nce.zeshel.config import ZeshelRetrieverConfig
from dist_nce.zeshel.grid import GridRow, load_rows, row_config


def main(argv: list[str] | None = None) -> int:
    ap = FlagParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=existing("file", "config file"), help="base retriever YAML")
    ap.add_argument("--rows", required=True, type=existing("file"), help="rows YAML (configs/zeshel/*_rows.yaml)")
    ap.add_argument("--out", required=True, help="grid directory (one sub-directory per row)")
    ap.add_argument("--only", type=names(), help="comma-separated row names to run (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every row")
    ap.add_argument("--dry-run", action="store_true",
                    help="check every row's config and input paths, then exit (no data generation, no Ray)")
    ap.add_argument("--no-untrained", dest="untrained", action="store_false",
                    help="do not evaluate the untrained model of each architecture")
    ap.add_help_config(ZeshelRetrieverConfig, "the base config's, which --set and the rows override")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    try:
        rows = load_rows(args.rows)
        if args.only:
            wanted = args.only
            unknown = [w for w in wanted if w not in {r.name for r in rows}]
            if unknown:
                raise ConfigError(f"--only: {','.join(wanted)}: no rows named {', '.join(unknown)} in {args.rows}")
            rows = [r for r in rows if r.name in wanted]
        configs = [(r, row_config(args.config, r, out, args.set)) for r in rows]
        grid_keys = {s.split("=", 1)[0].strip() for s in args.set}
        for r in rows:  # the row's overrides come last: say where one wins over the grid's --set
            both = sorted(grid_keys & {s.split("=", 1)[0].strip() for s in r.overrides})
            if both:
                print(f"[grid] {r.name}: the row sets {', '.join(both)} over the grid's --set (the row's value is "
                      f"used; {r.source or '--rows'})", file=sys.stderr, flush=True)
        for _, cfg in configs:
            RETRIEVER.ready(cfg)
    except (ConfigError, FileExistsError) as e:
        return error(e)
    if args.dry_run:
        return dry_run_ok(args.rows)
    # one live grid per --out (a second one stops here, status 2); each row's run is taken as it trains
    held = hold([(out, LOCK_FILE, f"grid directory {out}")], "use another --out")
    if isinstance(held, int):
        return held
    with held:
        return run_grid(args, configs, out)


def run_grid(args: argparse.Namespace, configs: list[tuple[GridRow, ZeshelRetrieverConfig]], out: Path) -> int:
    """The grid after its checks, in ``out``, which this process holds: stores, rows, tables."""
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.core.artifacts import ArtifactMismatch, atomic_write_json, atomic_write_text
    from dist_nce.index.encode import store_fingerprint
    from dist_nce.worker.tb import read_metrics
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.grid import (
        cell, comparison_text, comparisons, input_fingerprints, keyed, labels, markdown_table, noise_note, plot,
        result_key,
    )
    from dist_nce.zeshel.run import SUMMARY, run_retriever
    from kb.prepare import PrepareError

    configure_process(threads=None)
    log = lambda s: print(s, flush=True)  # noqa: E731
    start = time.perf_counter()
    try:  # the stores every row shares, prepared once up front
        stores = [ensure_zeshel_stores(cfg, log) for _, cfg in configs]
    except (ArtifactMismatch, PrepareError, FileNotFoundError, ValueError) as e:
        return error(e)
    except KeyboardInterrupt:
        return interrupted_preparing(", ".join(sorted({p for _, c in configs
                                                       for p in (c.data.prepared_dir, c.zeshel.eval_store)})))
    fingerprints = [[*(store_fingerprint(s) for s in pair), *input_fingerprints(cfg)]
                    for pair, (_, cfg) in zip(stores, configs)]
    configs = [(row, keyed(cfg, row.name, out, result_key(cfg, fps)))
               for (row, cfg), fps in zip(configs, fingerprints)]
    cells, pending = [], []
    if args.untrained:
        cells += untrained_cells(configs, fingerprints, out, log)
    for row, cfg in configs:
        summary_path = Path(cfg.run.output_dir) / SUMMARY
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        if summary.get("done") and summary.get("zeshel"):
            log(f"[grid] {row.name}: finished earlier, reusing {summary_path}")
        else:
            arch, neg = labels(cfg)
            row_held = hold_run(cfg.run)  # a job of its own may be training the row's run directory
            if isinstance(row_held, int):
                print(f"[grid] {row.name}: the rows before it are done and kept", file=sys.stderr, flush=True)
                return row_held
            log(f"[grid] {row.name}: training {arch} with {neg} negatives")
            try:
                with row_held:
                    summary = run_retriever(cfg, progress=False, log=log)
            except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train aborted the row's run
                print(f"[grid] {row.name}: the rows before it are done and kept", file=sys.stderr, flush=True)
                return interrupted(cfg.run)
        if not (summary.get("done") and summary.get("zeshel")):  # stopped at run.stop_after_steps: no recall yet
            pending.append(f"{row.name} (at step {summary.get('step')})")
            continue
        metrics = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
        losses = [m["train/loss"] for _, m in sorted(metrics.items()) if "train/loss" in m]
        cells.append(cell(row.name, cfg, summary, losses))

    verdicts = comparisons(cells)
    k = configs[0][1].zeshel.k
    title = (f"{Path(args.config).name} x {Path(args.rows).name}: top-{k} recall in %, macro over worlds. "
             "own world = each mention ranked among its own world's entities (Zeshel protocol); split union = "
             "among all entities of the split's worlds.")
    unfinished = (f"Not finished, so not in the table: {', '.join(pending)} (stopped at run.stop_after_steps; "
                  "run the grid again with it raised or unset to continue them).") if pending else ""
    # the question only where a finished row answers it (none yet: an empty section under it)
    compared = ("Do hard / mixed negatives beat random (own world, val and test)?\n\n" + comparison_text(verdicts)) \
        if verdicts else ""
    text = "\n\n".join(filter(None, [f"# Zeshel retriever grid\n\n{title}", markdown_table(cells), unfinished,
                                      compared, f"Resolution ({noise_note(cells)})."]))
    atomic_write_text(out / "grid.md", text + "\n")
    atomic_write_json(out / "grid.json", {"config": str(Path(args.config).resolve()), "rows": str(Path(args.rows)),
                                          "cells": cells, "comparisons": verdicts, "unfinished": pending,
                                          "seconds": round(time.perf_counter() - start, 1)})
    if cells:
        plot(cells, out / "grid.png", f"Zeshel grid ({Path(args.config).name}): top-{k} recall, own world, macro")
    else:  # nothing to draw: an earlier run's chart would sit beside this table as if it were its own
        (out / "grid.png").unlink(missing_ok=True)
    print(text, flush=True)
    print(f"wrote {out / 'grid.md'}, grid.json{', grid.png' if cells else ''} in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return 0


def untrained_cells(configs: list[tuple[GridRow, ZeshelRetrieverConfig]], fingerprints: list[list[str]], out: Path,
                    log: Callable[[str], None]) -> list[dict]:
    """The initial model of each architecture (same seed as its runs), evaluated on val/test."""
    import dataclasses

    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.train.model import build_retriever
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.evaluate import evaluate_retriever
    from dist_nce.zeshel.grid import cell, labels, result_key

    cells, seen = [], set()
    for (row, cfg), fps in zip(configs, fingerprints):
        arch = labels(cfg)[0]
        if arch in seen:
            continue
        seen.add(arch)
        # What an untrained model's scores depend on: the model, its seed, the data and the evaluation.
        key = result_key(cfg, fps, sections=("model", "data", "zeshel")) + f"s{cfg.optim.seed}"
        path = out / f"{arch}_untrained-{key}" / "summary.json"
        if path.exists():  # evaluated by an earlier run of the grid
            summary = json.loads(path.read_text())
        else:
            train_store, eval_store = ensure_zeshel_stores(cfg, log)
            retriever = build_retriever(cfg.model, cfg.optim.seed).eval()
            z = dataclasses.replace(cfg.zeshel, candidate_splits=[])
            reports = evaluate_retriever(retriever, train_store, eval_store, z, path.parent, False, lambda _: None)
            summary = {"done": True, "zeshel": reports}
            atomic_write_json(path, summary)
        cells.append(cell(f"{arch}_untrained", cfg, summary, negatives="untrained"))
        log(f"[grid] {arch} untrained: val {100 * cells[-1]['val/own_world/macro']:.2f}, test "
            f"{100 * cells[-1]['test/own_world/macro']:.2f} (own world, macro)")
    return cells


if __name__ == "__main__":
    sys.exit(main())
