"""Shard search backends and the exact Gumbel-top-k sampler, timed against faiss flat fp32.

On clustered synthetic vectors (N entities x d, B queries, k = 63 = K-1 negatives), in
one run and one thread, it measures for each backend of ``dist_nce.index.search``:

- queries per second and the ratio to the baseline (faiss flat fp32 top-k), timed in
  the same run (the machine may be shared: read the ratios, not the absolute rates);
- recall@k against exact top-k, and the largest score error against fp32 scores;
- fp16 storage exactness: faiss SQfp16 against exact scores of the fp16-rounded vectors;
- exact Gumbel-top-k (brute force + counter-based noise) and its cost over plain top-k;
- the sharded exact Gumbel sample (4 uneven shards + merge) against the flat one:
  identical ids and keys, and the time ratio;
- candidate-mode Gumbel on IVF: the estimated truncation (softmax mass outside the
  candidates) next to the true one computed from all scores.

Prints a table and writes benchmarks/results/search.json.

    .venv/bin/python -m benchmarks.search            # N=200k, d=128: ~1-2 minutes
    .venv/bin/python -m benchmarks.search --quick    # N=20k: seconds
    .venv/bin/python -m benchmarks.search --hnsw     # also HNSW (slow to build here)
"""
from __future__ import annotations

import argparse
import time

import torch


from benchmarks.common import add_hygiene_args, clustered, load_guard, machine_info, median_time, save_results  # noqa: E402
from dist_nce.cluster.runtime import configure_process  # noqa: E402
from dist_nce.index.config import IndexConfig  # noqa: E402
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec  # noqa: E402
from dist_nce.sampling.topk import ShardResult, merge_results  # noqa: E402

DUAL = ScoreSpec.preset("dual")


def recall(got: torch.Tensor, want: torch.Tensor) -> float:
    hits = [len(set(a) & set(b)) / len(b) for a, b in zip(got.tolist(), want.tolist())]
    return sum(hits) / len(hits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hnsw", action="store_true")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=63)
    ap.add_argument("--repeats", type=int, default=3)
    add_hygiene_args(ap)
    args = ap.parse_args()
    guard = load_guard(args.force)
    configure_process(threads=1)
    n = args.n or (20_000 if args.quick else 200_000)
    ents = clustered(n, args.d, max(16, n // 500), seed=0, scale=6.0)
    queries = clustered(args.batch, args.d, max(16, n // 500), seed=1, scale=6.0)
    gold = torch.randint(0, n, (args.batch,), generator=torch.Generator().manual_seed(2))
    qkeys = torch.arange(args.batch)
    k, nlist = args.k, max(16, int(4 * n ** 0.5))
    exact_scores = (queries @ ents.T).double()
    exact_scores[torch.arange(args.batch), gold] = float("-inf")
    truth = exact_scores.topk(k, dim=1).indices

    rows, meta = [], {}

    def add(name: str, seconds: float, res: ShardResult, build: float, **extra) -> None:
        err = (res.scores.double() - exact_scores.gather(1, res.ids.clamp(min=0))).abs().max().item()
        # For a Gumbel sample, overlap with the top-k is a property of the sample, not a recall.
        key = "overlap_with_topk" if name.startswith("gumbel") else "recall"
        rows.append({"backend": name, "qps": args.batch / seconds, "build_s": build,
                     key: recall(res.ids, truth), "max_score_err": err, **extra})

    def build(cfg: IndexConfig) -> tuple[ShardIndex, float]:
        t0 = time.perf_counter()
        idx = ShardIndex(DUAL, Reps(ents), 0, cfg)
        return idx, time.perf_counter() - t0

    configs = {
        "flat fp32 (baseline)": IndexConfig(backend="flat"),
        "flat fp16 (SQfp16)": IndexConfig(backend="flat", storage="fp16"),
        "torch fp32": IndexConfig(backend="torch"),
        "torch bf16": IndexConfig(backend="torch", compute="bf16"),
        f"ivf nlist={nlist} nprobe=64": IndexConfig(backend="ivf", nlist=nlist, nprobe=64, candidates=1024,
                                                    tail_sample=4096),
    }
    if args.hnsw:
        configs["hnsw M=16"] = IndexConfig(backend="hnsw", hnsw_m=16, ef_construction=80, ef_search=128,
                                           candidates=1024, tail_sample=4096)
    built = {name: build(cfg) for name, cfg in configs.items()}
    for name, (idx, b) in built.items():
        sec, res = median_time(lambda: idx.topk(queries, k, gold), args.repeats)
        extra = {}
        if "fp16" in name:  # exactness: the fp16-rounded vectors' exact scores
            dec = (queries @ ents.half().float().T).gather(1, res.ids)
            extra["max_err_vs_fp16_vectors"] = (res.scores - dec).abs().max().item()
        add(f"topk {name}", sec, res, b, **extra)

    flat_idx = built["torch fp32"][0]
    sec, flat_g = median_time(lambda: flat_idx.gumbel_topk(queries, k, gold, 7, qkeys), args.repeats)
    add("gumbel exact (torch, 1 shard)", sec, flat_g, built["torch fp32"][1])
    splits = [0, n // 7, n // 3, (2 * n) // 3, n]
    shards = [ShardIndex(DUAL, Reps(ents[a:b]), a, IndexConfig(backend="torch"))
              for a, b in zip(splits[:-1], splits[1:])]
    sec_sh, merged = median_time(
        lambda: merge_results([s.gumbel_topk(queries, k, gold, 7, qkeys) for s in shards], k), args.repeats)
    identical = bool(torch.equal(merged.ids, flat_g.ids) and torch.equal(merged.keys, flat_g.keys))
    add("gumbel exact (4 shards + merge)", sec_sh, merged, 0.0, identical_to_flat=identical)
    for name in [c for c in built if c.startswith(("ivf", "hnsw"))]:
        idx = built[name][0]
        sec, res = median_time(lambda: idx.gumbel_topk(queries, k, gold, 7, qkeys), args.repeats)
        cand = idx.topk(queries, 1024, gold).ids
        inside = torch.zeros_like(exact_scores, dtype=torch.bool).scatter(1, cand.clamp(min=0), cand >= 0)
        true_out = torch.exp(torch.logsumexp(exact_scores.masked_fill(inside, float("-inf")), 1)
                             - torch.logsumexp(exact_scores, 1))
        add(f"gumbel candidates ({name})", sec, res, built[name][1],
            truncation_est_mean=res.truncation().mean().item(), truncation_true_mean=true_out.mean().item(),
            truncation_abs_err_max=(res.truncation() - true_out).abs().max().item())

    base = rows[0]["qps"]
    for r in rows:
        r["speed_vs_flat_fp32"] = r["qps"] / base
    meta.update(n=n, d=args.d, batch=args.batch, k=k, threads=torch.get_num_threads(), **machine_info())
    print(f"N={n} d={args.d} B={args.batch} k={k} (1 thread)")
    print(f"{'search':44s} {'q/s':>8s} {'x flat':>7s} {'recall':>7s} {'max err':>9s} {'build s':>8s}  notes")
    for r in rows:
        notes = {key: (round(v, 6) if isinstance(v, float) else v) for key, v in r.items()
                 if key not in ("backend", "qps", "recall", "max_score_err", "build_s", "speed_vs_flat_fp32")}
        rec = f"{r['recall']:7.3f}" if "recall" in r else f"{'-':>7s}"
        print(f"{r['backend']:44s} {r['qps']:8.1f} {r['speed_vs_flat_fp32']:7.2f} {rec} "
              f"{r['max_score_err']:9.2e} {r['build_s']:8.2f}  {notes if notes else ''}")
    print(f"wrote {save_results('search', {'meta': meta, 'rows': rows, **guard})}")


if __name__ == "__main__":
    main()
