"""What one measurement of the live bias monitor costs a shard on SOM, before and after it shared
its scoring (issue 24, item 3).

A measurement asks the shards for (dist_nce/bias/monitor.py): ``draws`` candidate sets of each
of ``probe`` mentions from the run's own sampler (one request of probe x draws queries, the
probe repeated), the exact d/dq LSE over the whole KB, and d/dq LSE over every set. Timed in
the same run, interleaved, on the mini paper's SOM training KB (4 worlds x 500 entities, 32
columns, hidden 32; probe 16, draws 16, K = 16):

- ``before``: every query row scored (``share_queries=False``) and both gradients (over the KB
  and over the sets) by autograd (``autograd=True``), what the monitor did when the mini paper
  measured it;
- ``after``: repeated queries scored once (``index.exact.shared_queries``) and both gradients
  in closed form (``bias.gradbias._lse_grad_hard``, ``_lse_grad_rows_hard``).

for the hard arm (draws from the exact Gumbel-top-k) and the random arm (no draw reaches a
shard: only the two LSE passes). The JSON also carries the share of training time each arm's
monitor took in the committed mini paper (``docs/mini_paper/mini_paper.json``, ``bias/cost``)
and what that share becomes at the measured speed-up, a projection (the training steps are not
rerun here). Writes benchmarks/results/monitor.json.

    .venv/bin/python -m benchmarks.monitor            # ~2 minutes, 1 thread, alone on the machine
    .venv/bin/python -m benchmarks.monitor --quick    # seconds: a smaller KB, nothing saved
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import (add_hygiene_args, compare, interleaved, load_guard, machine_info, print_table,
                               save_results, som_kb)
from dist_nce.bias.gradbias import estimate, lse_grad_all, lse_grad_rows
from dist_nce.cluster.runtime import configure_threads
from dist_nce.index.exact import exact_search
from dist_nce.modeling.scoring import Reps, ScoreSpec

MINI_PAPER = Path(__file__).resolve().parents[1] / "docs" / "mini_paper" / "mini_paper.json"


def measurement(spec: ScoreSpec, ents: Reps, probe: Reps, draws: int, negatives: int, hard: bool,
                shared: bool, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One monitor measurement's shard work -> (candidate sets [probe, draws, K], bias [probe, ...])."""
    p = probe.vecs.shape[0]
    gold = torch.arange(p) * 7 % ents.vecs.shape[0]
    reps = Reps(probe.vecs.repeat(draws, 1, 1), probe.mask.repeat(draws, 1))
    keys = torch.arange(p).repeat(draws) + (1 << 40) * torch.arange(1, draws + 1).repeat_interleave(p)
    if hard:
        neg = exact_search(spec, reps, ents, 0, negatives, gold.repeat(draws), chunk_rows, seed=3, query_keys=keys,
                           kernel="torch", share_queries=shared).ids
    else:
        g = torch.Generator().manual_seed(3)
        neg = torch.randint(0, ents.vecs.shape[0], (p * draws, negatives), generator=g)
    sets = torch.cat([gold.repeat(draws)[:, None], neg], dim=1).view(draws, p, -1).transpose(0, 1).contiguous()
    full = lse_grad_all(spec, probe, ents, chunk_rows, autograd=not shared)
    cand = lse_grad_rows(spec, probe, ents, sets, autograd=not shared)
    return sets, estimate(full, cand).bias


def committed_costs() -> dict:
    """The mini paper's SOM bias/cost per arm: {arm: [per-seed shares of training time]}."""
    if not MINI_PAPER.exists():
        return {}
    cells = json.loads(MINI_PAPER.read_text())["cells"]
    out: dict[str, list[float]] = {}
    for cell in cells:
        if cell.get("architecture") == "som" and cell.get("arm") and "bias/cost" in cell.get("metrics", {}):
            out.setdefault(cell["arm"], []).append(cell["metrics"]["bias/cost"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 400-entity KB, 2 repeats, nothing saved")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/monitor.json)")
    add_hygiene_args(ap)
    args = ap.parse_args()
    guard = load_guard(args.force)
    configure_threads(1)
    n, cols, dim, probe, draws, k = (400 if args.quick else 2000), 32, 32, 16, 16, 16
    repeats = 2 if args.quick else args.repeats
    spec = ScoreSpec.preset("som")
    ents, q = som_kb(n, cols, dim, probe)
    chunk = 4096
    # The same answer either way: the same draws, and the bias vectors equal up to float32
    # rounding of the gradients (|grad| ~ 4 here; a bias norm itself can be far smaller).
    for hard in (True, False):
        (sets_a, bias_a), (sets_b, bias_b) = (measurement(spec, ents, q, draws, k - 1, hard, shared, chunk)
                                              for shared in (False, True))
        assert torch.equal(sets_a, sets_b)
        torch.testing.assert_close(bias_a, bias_b, rtol=0, atol=1e-4)
    methods = {f"{arm} {how}": (lambda hard=(arm == "hard"), shared=(how == "after"):
                                measurement(spec, ents, q, draws, k - 1, hard, shared, chunk))
               for arm in ("hard", "random") for how in ("before", "after")}
    times = interleaved(methods, repeats)
    costs = committed_costs()
    rows = []
    for arm in ("hard", "random"):
        before, after = times[f"{arm} before"], times[f"{arm} after"]
        c = compare(after, before)
        share = costs.get({"hard": "hard", "random": "random"}[arm], [])
        rows.append({"arm": arm, "before_s": before["median"], "after_s": after["median"],
                     "x_median": c["x_median"], "x_low": c["x_low"], "x_high": c["x_high"],
                     "distinct": c["distinct"],
                     "committed_share": statistics.median(share) if share else None,
                     "projected_share": (statistics.median(share) * c["x_median"]) if share else None,
                     "committed_share_max": max(share) if share else None,
                     "projected_share_max": (max(share) * c["x_high"]) if share else None})
    print(f"SOM monitor measurement, {n} entities x {cols} columns x {dim}, probe {probe} x {draws} draws, K={k}")
    print_table(rows, [("arm", "arm", "<7s"), ("before_s", "before s", ">9.3f"), ("after_s", "after s", ">8.3f"),
                       ("x_median", "after/before", ">12.3f"), ("committed_share", "share then", ">10.3f"),
                       ("projected_share", "share now (proj.)", ">17.3f")])
    if args.quick:
        return
    payload = {"benchmark": "monitor", "config": {"entities": n, "columns": cols, "dim": dim, "probe": probe,
                                                  "draws": draws, "k": k, "chunk_rows": chunk,
                                                  "repeats": repeats, "threads": 1},
               "methods": times, "rows": rows, "machine": machine_info(), **guard}
    print("wrote", save_results("monitor", payload, args.out))


if __name__ == "__main__":
    main()
