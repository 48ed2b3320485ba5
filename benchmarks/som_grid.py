"""SOM's exact search on the auto chunk grid, before and after the grid was scaled by the vectors
per entity row (issue 24, item 1: SOM with MiniLM on unseen worlds).

The exact path scores entities in blocks of a global grid of ``chunk_rows`` rows and pads a
shard's partial blocks with zero rows that are scored too (``index.exact``): that keeps the Gumbel
draws identical whichever shard holds a row. The CPU's auto grid was 8192 rows whatever the reps,
so a SOM world of 500 entities x 32 token vectors paid the GEMM of 8192 rows. It is now 8192 / T
rows (256 for T = 32). Timed in the same run, interleaved, on MiniLM's shapes (32 token vectors of
384 per entity and per mention, one thread):

- ``eval world``: 128 mentions' exact top-64 in one 500-entity world (the unseen-world evaluation
  runs this once per world and batch);
- ``train KB``: 8 mentions' 15 hard negatives by the exact Gumbel-top-k (block sampler) over the
  2,000 training entities (one training step's shard request).

``before`` names ``chunk_rows: 8192``, the old auto value; ``after`` leaves it at 0 (auto). The
top-k ids of the two grids are compared (the scores may differ in the last bits: BLAS sums a
256-row and an 8192-row block in different orders). Writes benchmarks/results/som_grid.json.

    .venv/bin/python -m benchmarks.som_grid            # ~1 minute, alone on the machine
    .venv/bin/python -m benchmarks.som_grid --quick    # seconds: smaller sizes, nothing saved
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import (add_hygiene_args, compare, interleaved, load_guard, machine_info, print_table,
                               save_results, som_kb)
from dist_nce.cluster.runtime import configure_threads
from dist_nce.index.exact import auto_chunk_rows, exact_search
from dist_nce.modeling.scoring import Reps, ScoreSpec

OLD_CPU_GRID = 8192


def workloads(quick: bool) -> list[dict]:
    scale = 4 if quick else 1
    return [dict(name="eval world", entities=500 // scale, batch=128 // scale, k=64, sampler=False),
            dict(name="train KB", entities=2000 // scale, batch=8, k=15, sampler=True)]


def search(spec: ScoreSpec, q: Reps, ents: Reps, gold: torch.Tensor, k: int, sampler: bool, chunk_rows: int):
    kw = dict(seed=3, query_keys=torch.arange(q.vecs.shape[0]), sampler="block", block_rows=128) if sampler else {}
    return exact_search(spec, q, ents, 0, k, gold, chunk_rows, kernel="torch", **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the sizes, 2 repeats, nothing saved")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/som_grid.json)")
    add_hygiene_args(ap)
    args = ap.parse_args()
    guard = load_guard(args.force)
    configure_threads(1)
    cols, dim = 32, 384
    repeats = 2 if args.quick else args.repeats
    spec = ScoreSpec.preset("som")
    rows, times = [], {}
    for i, w in enumerate(workloads(args.quick)):
        ents, q = som_kb(w["entities"], cols, dim, w["batch"], seed=i)
        gold = torch.arange(w["batch"]) * 7 % w["entities"]
        before = search(spec, q, ents, gold, w["k"], w["sampler"], OLD_CPU_GRID)
        after = search(spec, q, ents, gold, w["k"], w["sampler"], 0)
        same = (before.ids == after.ids).float().mean().item()
        t = interleaved({f"{w['name']} before": lambda: search(spec, q, ents, gold, w["k"], w["sampler"],
                                                               OLD_CPU_GRID),
                         f"{w['name']} after": lambda: search(spec, q, ents, gold, w["k"], w["sampler"], 0)},
                        repeats)
        times.update(t)
        b, a = t[f"{w['name']} before"], t[f"{w['name']} after"]
        c = compare(a, b)
        rows.append({"workload": w["name"], "entities": w["entities"], "batch": w["batch"], "k": w["k"],
                     "grid_before": OLD_CPU_GRID, "grid_after": auto_chunk_rows("cpu", w["batch"], 128, cols),
                     "before_s": b["median"], "after_s": a["median"], "x_median": c["x_median"],
                     "x_low": c["x_low"], "x_high": c["x_high"], "distinct": c["distinct"],
                     "mentions_per_s_before": w["batch"] / b["median"],
                     "mentions_per_s_after": w["batch"] / a["median"], "same_ids": same})
    print(f"SOM exact search, {cols} x {dim} token vectors per entity and mention, one thread")
    print_table(rows, [("workload", "workload", "<11s"), ("entities", "N", ">6d"), ("batch", "B", ">4d"),
                       ("grid_before", "grid then", ">10d"), ("grid_after", "grid now", ">9d"),
                       ("before_s", "then s", ">8.3f"), ("after_s", "now s", ">7.3f"),
                       ("x_median", "now/then", ">9.3f"), ("mentions_per_s_after", "mentions/s now", ">15.1f"),
                       ("same_ids", "same ids", ">9.4f")])
    if args.quick:
        return
    payload = {"benchmark": "som_grid", "config": {"columns": cols, "dim": dim, "repeats": repeats, "threads": 1,
                                                   "block_rows": 128},
               "methods": times, "rows": rows, "machine": machine_info(), **guard}
    print("wrote", save_results("som_grid", payload, args.out))


if __name__ == "__main__":
    main()
