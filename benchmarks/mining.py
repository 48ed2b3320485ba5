"""Mining throughput: the NegativeService (S Ray shard actors) against in-process search.

On N clustered synthetic entities x d (default 1M x 128; queries are noisy copies of
their gold entity), in ONE run and with the SAME total threads (S shard processes of
one thread each against one process of S threads), it times requests of B queries for

- top-k (k = K-1 = 63): an in-process faiss flat index (the baseline), an in-process
  torch brute-force top-k, and ``NegativeService.topk`` over S faiss-flat shards;
- hard-negative mining (exact Gumbel-top-k, K-1 = 63, ``--gumbel-batch`` queries per
  request): the in-process exact sampler (``ShardIndex.gumbel_topk`` +
  ``negatives.hard_negatives``, the baseline) and ``NegativeService.mine``;

each service row with P requests in flight (a trainer keeps P batches in flight).
Two more in-process references separate the causes of any difference:

- the same index on ONE thread: S x its rate is what perfect scaling of one index to S
  threads would give (column "x S*1thr");
- "S partitions x 1 thread, no Ray": the service's row split, searched by S Python
  threads of one BLAS thread each and merged in-process; service minus this is the cost
  of Ray itself (calls, serialization, scheduling).

Reported: queries/s, the ratio to the baseline, the Ray overhead (service time minus
in-process time per query, and as a fraction of it), and the achieved GFLOP/s
(2 B N d per search) against this machine's fp32 GEMM rate (``torch.mm`` of 2048^2
matrices on 1 and S threads, measured in the same run; "of Sx1thr GEMM" divides by S
times the one-thread rate). Plus a no-op fan-out round trip and the agreement of the
service's answers with the in-process ones.

On a shared machine a process of S threads suffers most: every parallel region waits
for its slowest thread, and the exact Gumbel path runs many small ones (the noise
blocks). Read the "x S*1thr" and "no Ray" columns beside "x base".

Methods are timed round-robin (repeat 1 of every method, then repeat 2, ...) and the
median is kept, so load from other processes spreads over all rows alike. Prints a
table; writes benchmarks/results/mining.json.

    .venv/bin/python -m benchmarks.mining                    # N=1M, d=128, S=2: ~6-9 minutes here
    .venv/bin/python -m benchmarks.mining --n 100000 --calls 2 --repeats 1   # smoke run
    .venv/bin/python -m benchmarks.mining --sampler both     # + the block sampler's in-process rows

Every run also times, on one thread, the exact samplers (dense, block) x scoring precision
(fp32, ``index.score_dtype`` bf16) beside faiss flat top-k on one thread, all interleaved,
and reports each one's cost per query against faiss top-k (median ratio and the range the
min/max spreads allow) and its GFLOP/s against the fp32 and bf16 GEMM peaks measured in the
same run. Refuses to record above load average 1.5 unless ``--force`` (then ``"noisy"``).

The rows named "(torch kernel)" or without a kernel pin ``index.kernel: torch`` (what they
measured before the AVX2 kernel existed); "(native kernel)" is the AVX512-BF16 kernel. The rows
"(AVX2+FMA kernel ...)" run ``native/block_fp32.c``, the path of a CPU with AVX2 and FMA but
no AVX512-BF16: where this CPU has AVX512-BF16 it is hidden from the kernel checks
(``DIST_NCE_NATIVE_MASK=avx512_bf16``, read at each call) and the label says so; the kernel
itself is compiled without any AVX512 instruction. They cover the block sampler on fp32 and
bf16 rows and the exact top-k on fp32 rows (``--avx2 off`` leaves them out).
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import faiss
import torch


from benchmarks.common import (add_hygiene_args, clustered, compare, gemm_peaks, load_guard,  # noqa: E402
                               machine_info, median_time, print_table, save_results, spread, unit_centres,
                               vector_service)
from dist_nce.actors.config import ServiceConfig  # noqa: E402
from dist_nce.actors.service import even_ranges  # noqa: E402
from dist_nce.cluster.runtime import configure_process, init_ray  # noqa: E402
from dist_nce.index.config import IndexConfig  # noqa: E402
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec  # noqa: E402
from dist_nce.sampling import block_native  # noqa: E402
from dist_nce.sampling.negatives import hard_negatives  # noqa: E402
from dist_nce.sampling.topk import merge_results  # noqa: E402

DUAL = ScoreSpec.preset("dual")


def pipelined(submit: Callable[[int], Any], calls: int, in_flight: int) -> float:
    """Seconds to answer ``calls`` requests keeping up to ``in_flight`` of them submitted."""
    t0 = time.perf_counter()
    pending: collections.deque = collections.deque()
    for j in range(calls):
        pending.append(submit(j))
        if len(pending) >= in_flight:
            pending.popleft().result()
    while pending:
        pending.popleft().result()
    return time.perf_counter() - t0


class _Done:
    """An in-process answer, shaped like a service future."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="entities")
    ap.add_argument("--d", type=int, default=128, help="dimension")
    ap.add_argument("--shards", type=int, default=2, help="S shard actors (1 thread each)")
    ap.add_argument("--batch", type=int, default=128, help="B queries per top-k request")
    ap.add_argument("--gumbel-batch", type=int, default=128, help="queries per exact Gumbel request")
    ap.add_argument("--k", type=int, default=63, help="K-1 negatives")
    ap.add_argument("--calls", type=int, default=4, help="requests per timed repeat and method")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per method (median)")
    ap.add_argument("--in-flight", default="1,4", help="comma-separated P values for the service rows")
    ap.add_argument("--sampler", choices=["dense", "block", "both"], default="block",
                    help="exact Gumbel sampler (index.sampler); both: the service and the baselines use dense and "
                         "the in-process Gumbel rows are repeated with block, interleaved in the same repeats")
    ap.add_argument("--exact", choices=["bf16", "fp32"], default="bf16",
                    help="the exact Gumbel rows' index (in-process and service): bf16 = backend torch with "
                         "index.score_dtype bf16 (the native block kernel where it runs), fp32 = the faiss flat "
                         "index's fp32 rows. The top-k rows always use faiss flat fp32 (a second service when bf16)")
    ap.add_argument("--block-rows", type=int, default=128, help="index.block_rows of the block sampler")
    ap.add_argument("--chunk-rows", type=int, default=8192, help="index.chunk_rows of the exact path (larger chunks "
                    "amortise the block sampler's per-chunk work; must be a multiple of --block-rows)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mining.json)")
    ap.add_argument("--no-service", action="store_true",
                    help="in-process rows only (no Ray): the exact-vs-top-k comparison without the service rows")
    ap.add_argument("--avx2", choices=["auto", "off"], default="auto",
                    help="auto: time the AVX2+FMA kernel's rows where it runs (AVX512-BF16 masked where present)")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    if args.no_service:
        args.in_flight = ""
    S, B, Bg, k = args.shards, args.batch, min(args.gumbel_batch, args.batch), args.k
    flights = [int(p) for p in args.in_flight.split(",") if p]
    configure_process(threads=S)  # the in-process baselines get the service's total threads
    guard = load_guard(args.force)
    load_before = guard["load_average_before"]
    peaks = {1: gemm_peaks(1), S: gemm_peaks(S)}
    peak = {t: p["fp32"] for t, p in peaks.items()}
    print(f"GEMM peak (torch.mm): fp32 {peak[1]:.1f} GFLOP/s on 1 thread, {peak[S]:.1f} on {S}; bf16 "
          f"{peaks[1]['bf16']:.1f} on 1 thread ({'native' if peaks[1]['bf16_native'] else 'EMULATED: no bf16 units'}); "
          f"load average {load_before:.1f} on {os.cpu_count()} cores", flush=True)

    # ---- data: clustered entities; each query is a noisy copy of its gold entity
    clusters = max(16, args.n // 500)
    centres = unit_centres(clusters, args.d, seed=0)
    t0 = time.perf_counter()
    ents = clustered(args.n, args.d, clusters, seed=1, scale=4.0, centres=centres)
    topk_calls = args.calls
    g = torch.Generator().manual_seed(2)
    gold = torch.randint(0, args.n, (topk_calls, B), generator=g)
    noise = torch.randn(topk_calls, B, args.d, generator=g) * 0.5 / args.d ** 0.5
    queries = 4.0 * torch.nn.functional.normalize(ents[gold] / 4.0 + noise, dim=-1)
    qkeys = torch.arange(topk_calls * B).view(topk_calls, B)
    gq, ggold, gkeys = queries[:, :Bg], gold[:, :Bg], qkeys[:, :Bg]  # the Gumbel requests
    print(f"data: {args.n:,} x {args.d} clustered ({clusters} clusters) in {time.perf_counter() - t0:.1f} s",
          flush=True)

    # ---- in-process: one index on S threads; S row partitions on S Python threads of 1 BLAS thread
    # each (the service's partition without Ray); the service: S actors x 1 thread
    sampler = "dense" if args.sampler == "both" else args.sampler
    # the rows below measure what they measured before the AVX2 kernel: torch for fp32 rows, and for bf16 rows
    # the AVX512-BF16 kernel where it runs, else torch (the AVX2 kernel has rows of its own: avx2_rows)
    kernel = "native" if block_native.usable(True, ents[:1].bfloat16().float(), ents[:1].bfloat16(),
                                             args.block_rows, block_native.BF16) is None else "torch"
    pinned = "auto" if kernel == "native" else "torch"
    index_cfg = IndexConfig(backend="flat", sampler=sampler, block_rows=args.block_rows, chunk_rows=args.chunk_rows,
                            kernel="torch")
    index_cfg.validate()
    flat = ShardIndex(DUAL, Reps(ents), 0, index_cfg)
    brute = ShardIndex(DUAL, Reps(ents), 0, IndexConfig(backend="torch", chunk_rows=args.chunk_rows, kernel="torch"))
    ranges = even_ranges(args.n, S, args.block_rows if args.sampler != "dense" else 1)
    parts = [ShardIndex(DUAL, Reps(ents[a:b]), a, index_cfg) for a, b in ranges]
    exact_cfg = index_cfg if args.exact == "fp32" else IndexConfig(
        backend="torch", score_dtype="bf16", sampler=sampler, block_rows=args.block_rows, chunk_rows=args.chunk_rows,
        kernel=pinned)
    exact = flat if args.exact == "fp32" else ShardIndex(DUAL, Reps(ents), 0, exact_cfg)
    exact_parts = parts if args.exact == "fp32" else [ShardIndex(DUAL, Reps(ents[a:b]), a, exact_cfg)
                                                      for a, b in ranges]
    print(f"exact rows: {args.exact} ({exact_cfg.backend}, sampler {sampler}"
          f"{', kernel ' + kernel if args.exact == 'bf16' and sampler == 'block' else ''})", flush=True)

    def with_sampler(index: ShardIndex, name: str) -> ShardIndex:
        """The same index (same vectors and faiss structure, no copy) searching with another sampler."""
        other = copy.copy(index)
        other.config = dataclasses.replace(index.config, sampler=name)
        return other

    flat_block = with_sampler(flat, "block")
    parts_block = [with_sampler(part, "block") for part in parts]
    # bf16 scoring (index.score_dtype): its own bf16 copy of the rows (torch backend), both samplers, and the
    # block sampler on the torch kernel (chunked GEMM + reductions) beside the native one
    bf16_block = exact if args.exact == "bf16" and sampler == "block" else ShardIndex(
        DUAL, Reps(ents), 0, IndexConfig(backend="torch", score_dtype="bf16", sampler="block",
                                         block_rows=args.block_rows, chunk_rows=args.chunk_rows, kernel=pinned))
    bf16 = {"dense": with_sampler(bf16_block, "dense"), "block": bf16_block}
    bf16_torch_kernel = copy.copy(bf16_block)
    bf16_torch_kernel.config = dataclasses.replace(bf16_block.config, kernel="torch")
    flat_dense = with_sampler(flat, "dense")
    avx2 = avx2_rows(args, ents, gq, ggold, gkeys, queries, gold, k) if args.avx2 == "auto" else None
    pool = ThreadPoolExecutor(S)
    service = mine_service = root = start_s = mine_start_s = None
    if not args.no_service:
        init_ray(num_cpus=os.cpu_count())
        root = tempfile.mkdtemp(prefix="dist-nce-mining-")
        services = 2 if args.exact == "bf16" else 1  # Ray CPUs are split so both services' actors fit
        cfg = ServiceConfig(num_shards=S, num_cpus=min(1.0, os.cpu_count() / S / services), threads=1,
                            max_concurrency=max(4, max(flights)), index=index_cfg)
        service, start_s = vector_service(os.path.join(root, "flat"), args.n, args.d, lambda i, a, b: ents[a:b], cfg)
        print(f"service: {S} shards serving in {start_s:.1f} s (reload + faiss build)", flush=True)
        mine_service, mine_start_s = service, start_s
        if args.exact == "bf16":  # the exact rows' shards hold bf16 rows (half the bytes), on the same CPUs
            mine_service, mine_start_s = vector_service(
                os.path.join(root, "bf16"), args.n, args.d, lambda i, a, b: ents[a:b],
                dataclasses.replace(cfg, index=exact_cfg), storage_dtype="bfloat16")
            print(f"service (exact rows): {S} bf16 shards serving in {mine_start_s:.1f} s", flush=True)

    def partitioned(search: Callable[[ShardIndex, int], Any], finish: Callable[[list], Any], over=parts):
        def run(j: int) -> _Done:
            def one(part: ShardIndex):
                faiss.omp_set_num_threads(1)  # faiss's OpenMP threads are per calling thread
                return search(part, j)
            return _Done(finish(list(pool.map(one, over))))
        return run

    def in_process(fn: Callable[[int], Any]) -> Callable[[int], _Done]:
        return lambda j: _Done(fn(j))

    one, many = f"1 process x {S} threads", f"{S} partitions x 1 thread, no Ray"
    tag = "" if args.sampler == "both" else f" {sampler}"
    # name -> (group, submit, requests per repeat, in flight, BLAS threads per search)
    methods: dict[str, tuple] = {
        f"topk: faiss flat, {one} (baseline)": (
            "topk", in_process(lambda j: flat.topk(queries[j], k, gold[j])), topk_calls, 1, S),
        "topk: faiss flat, 1 process x 1 thread": (
            "topk", in_process(lambda j: flat.topk(queries[j], k, gold[j])), topk_calls, 1, 1),
        f"topk: torch brute force, {one}": (
            "topk", in_process(lambda j: brute.topk(queries[j], k, gold[j])), topk_calls, 1, S),
        f"topk: faiss flat, {many}": (
            "topk", partitioned(lambda part, j: part.topk(queries[j], k, gold[j]),
                                lambda res: merge_results(res, k)), topk_calls, 1, 1),
        **{f"topk: service S={S}, P={p}": (
            "topk", lambda j: service.topk(queries[j], k, gold[j]), topk_calls, p, 1) for p in flights},
        f"gumbel: exact{tag}, {one} (baseline)": ("gumbel", in_process(lambda j: hard_negatives(
            exact.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k)), args.calls, 1, S),
        f"gumbel: exact{tag}, 1 process x 1 thread": ("gumbel", in_process(lambda j: hard_negatives(
            exact.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k)), args.calls, 1, 1),
        f"gumbel: exact{tag}, {many}": (
            "gumbel", partitioned(lambda part, j: part.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]),
                                  lambda res: hard_negatives(merge_results(res, k), k), exact_parts),
            args.calls, 1, 1),
        **{f"gumbel: service mine S={S}, P={p}": ("gumbel", lambda j: mine_service.mine(
            gq[j], ggold[j], k, 0, 11, gkeys[j]), args.calls, p, 1) for p in flights},
    }
    references = set(methods)  # the rows below are compared, never references
    if args.sampler == "both":  # the block sampler on the same indexes, interleaved with the rows above
        methods.update({
            f"gumbel: exact block, {one}": ("gumbel", in_process(lambda j: hard_negatives(
                flat_block.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k)), args.calls, 1, S),
            "gumbel: exact block, 1 process x 1 thread": ("gumbel", in_process(lambda j: hard_negatives(
                flat_block.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k)), args.calls, 1, 1),
            f"gumbel: exact block, {many}": (
                "gumbel", partitioned(lambda part, j: part.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]),
                                      lambda res: hard_negatives(merge_results(res, k), k), parts_block),
                args.calls, 1, 1)})
    # The exact samplers x scoring precision on ONE thread, beside faiss flat top-k on one thread
    # (issue 12: exact mining <= 1.2x top-k on the same threads), interleaved with everything above.
    for name, index in (("dense fp32", flat_dense), ("block fp32", flat_block), ("dense bf16", bf16["dense"]),
                        (f"block bf16 ({kernel} kernel)", bf16["block"]),
                        *([("block bf16 (torch kernel)", bf16_torch_kernel)] if kernel == "native" else [])):
        methods.setdefault(f"gumbel: exact {name}, 1 process x 1 thread", ("gumbel", in_process(
            lambda j, index=index: hard_negatives(index.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k)),
            args.calls, 1, 1))
    if kernel == "native" and args.exact == "bf16" and sampler == "block":
        # The kernel alone (bf16 scores, block logsumexp, block noise, best-block selection): the
        # scoring part of the block sampler, read against the bf16 GEMM peak; step 3 (rows given
        # their block maximum) is the rest of the row above.
        from dist_nce.index.exact import _native_calls, Piece

        kernel_calls = _native_calls([Piece(0, exact.entities)], args.chunk_rows, args.block_rows, 1)
        methods["gumbel: native kernel alone (scoring + block selection), 1 process x 1 thread"] = (
            "gumbel", in_process(lambda j: block_native.run_calls(
                kernel_calls, gq[j].bfloat16(), k, ggold[j], None, 11, gkeys[j], args.block_rows, 1)),
            args.calls, 1, 1)
    if avx2 is not None:  # the AVX2 kernel's rows, compared like the rows above
        methods.update(avx2["methods"])
    times: dict[str, list[float]] = {name: [] for name in methods}

    def threads(n: int) -> None:
        torch.set_num_threads(n)
        faiss.omp_set_num_threads(n)

    for name, (_, submit, _, p, t) in methods.items():  # warm-up: one request each
        threads(t)
        pipelined(submit, 1, p)
    for rep in range(args.repeats):
        for name, (_, submit, calls, p, t) in methods.items():
            threads(t)
            times[name].append(pipelined(submit, calls, p))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    threads(S)

    # ---- agreement of the service's answers with the in-process ones (same data, same seeds)
    pool.shutdown()
    agreement, noop_s = None, float("nan")
    if service is not None:
        svc_topk = service.topk(queries[0], k, gold[0]).result()
        ref_topk = flat.topk(queries[0], k, gold[0])
        svc_mine = mine_service.mine(gq[0], ggold[0], k, 0, 11, gkeys[0]).result()
        ref_mine = exact.gumbel_topk(gq[0], k, ggold[0], 11, gkeys[0])
        agreement = {"topk_ids_equal_fraction": float((svc_topk.ids == ref_topk.ids).float().mean()),
                     "gumbel_ids_equal_fraction": float((svc_mine.negatives.ids == ref_mine.ids).float().mean())}
        noop_s, _ = median_time(lambda: service.status(), 10)

    rows, base, no_ray, single = [], {}, {}, {}
    for name, (group, _, calls, p, t) in methods.items():
        batch = B if group == "topk" else Bg
        per_request = statistics.median(times[name]) / calls
        gflops = 2 * batch * args.n * args.d / per_request / 1e9  # 2 B N d per search
        row = {"method": name, "group": group, "in_flight": p, "requests": calls, "batch": batch,
               "blas_threads_per_search": t, "qps": batch / per_request, "ms_per_query": 1e3 * per_request / batch,
               "gflops": gflops, "fraction_of_gemm_peak": gflops / (S * peak[1]), "seconds_all": times[name],
               "seconds_per_query": spread([x / (calls * batch) for x in times[name]])}
        if t in peaks:  # achieved rate against both peaks measured in this run on the same threads
            row["fraction_of_fp32_peak"] = gflops / peaks[t]["fp32"]
            row["fraction_of_bf16_peak"] = gflops / peaks[t]["bf16"]
        if "baseline" in name:
            base[group] = row
        reference = name in references
        if "no Ray" in name and reference:
            no_ray[group] = row
        if "1 process x 1 thread" in name and reference:
            single[group] = row
        rows.append(row)
    faiss_1thr = next(r for r in rows if r["method"] == "topk: faiss flat, 1 process x 1 thread")
    for row in rows:  # cost per query against faiss flat top-k on the same threads, spreads kept
        same = faiss_1thr if row["blas_threads_per_search"] == 1 else base["topk"]
        if "service" not in row["method"] and "no Ray" not in row["method"]:  # in-process rows
            row["vs_faiss_topk"] = compare(row["seconds_per_query"], same["seconds_per_query"])
            row["x_faiss_topk"] = row["vs_faiss_topk"]["x_median"]
    for row in rows:
        b = base[row["group"]]
        row["x_baseline"] = row["qps"] / b["qps"]
        # S x the one-thread in-process index: what perfect scaling of one index to S threads would give
        row["x_ideal_scaling"] = row["qps"] / (S * single[row["group"]]["qps"])
        if "service" in row["method"] and no_ray:
            row["ray_overhead_ms_per_query"] = row["ms_per_query"] - b["ms_per_query"]
            row["ray_overhead_fraction"] = row["ray_overhead_ms_per_query"] / b["ms_per_query"]
            row["overhead_vs_no_ray_ms_per_query"] = row["ms_per_query"] - no_ray[row["group"]]["ms_per_query"]
            row["overhead_vs_no_ray_fraction"] = (row["overhead_vs_no_ray_ms_per_query"]
                                                  / no_ray[row["group"]]["ms_per_query"])
    if service is not None:
        service.shutdown()
        if mine_service is not service:
            mine_service.shutdown()
        shutil.rmtree(root, ignore_errors=True)  # the persisted shard vectors

    print(f"\nN={args.n:,} d={args.d} B={B} (Gumbel: {Bg}) k={k}, S={S} shards x 1 thread vs 1 process x {S} threads; "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print_table(rows, [("method", "method", "<56s"), ("qps", "q/s", ">8.1f"), ("x_baseline", "x base", ">6.2f"),
                       ("ms_per_query", "ms/q", ">7.2f"), ("ray_overhead_ms_per_query", "-base ms/q", ">8.2f"),
                       ("ray_overhead_fraction", "-base frac", ">6.2f"),
                       ("overhead_vs_no_ray_ms_per_query", "-noRay ms/q", ">8.2f"),
                       ("overhead_vs_no_ray_fraction", "-noRay frac", ">6.2f"),
                       ("x_ideal_scaling", f"x {S}*1thr", ">7.2f"), ("gflops", "GFLOP/s", ">8.1f"),
                       ("fraction_of_gemm_peak", f"of {S}x1thr GEMM", ">6.2f"),
                       ("x_faiss_topk", "x faiss top-k", ">7.2f"), ("fraction_of_bf16_peak", "of bf16 peak", ">7.3f")])
    print("exact mining vs faiss flat top-k on the same threads (median cost ratio [range the spreads allow]; "
          "'=' when the spreads overlap):")
    for row in rows:
        if row["group"] == "gumbel" and "vs_faiss_topk" in row:
            v = row["vs_faiss_topk"]
            print(f"  {row['method']:<56s} {v['x_median']:6.2f}x [{v['x_low']:.2f}, {v['x_high']:.2f}]"
                  f"{'' if v['distinct'] else ' ='}")
    print(f"GEMM speed-up of {S} threads over 1 in this run: {peak[S] / peak[1]:.2f}x (bounds what any {S}-way "
          f"parallel row can gain over the 1-thread one; 'x {S}*1thr' assumes {S}x)")
    print(f"no-op fan-out round trip (status of {S} shards): {1e3 * noop_s:.1f} ms; agreement with "
          f"in-process: {agreement}")
    out = save_results("mining", {
        "benchmark": "mining", "n": args.n, "d": args.d, "shards": S, "batch": B, "gumbel_batch": Bg, "k": k,
        "sampler": args.sampler, "exact": args.exact, "kernel": kernel, "block_rows": args.block_rows,
        "avx2_kernel": None if avx2 is None else avx2["record"],
        "chunk_rows": args.chunk_rows, "mine_service_start_s": mine_start_s,
        "gemm_peak_gflops": {str(t): v for t, v in peak.items()},
        "gemm_peaks": {str(t): v for t, v in peaks.items()}, "service_start_s": start_s, **guard,
        "noop_fanout_ms": 1e3 * noop_s, "agreement": agreement, "rows": rows,
        "machine": machine_info(threads_in_process=S, threads_per_shard=1, load_average_before=load_before),
    }, args.out)
    print(f"wrote {out}")


def avx2_rows(args: argparse.Namespace, ents: torch.Tensor, gq: torch.Tensor, ggold: torch.Tensor,
              gkeys: torch.Tensor, queries: torch.Tensor, gold: torch.Tensor, k: int) -> dict | None:
    """The AVX2+FMA kernel's rows (``native/block_fp32.c``) as a CPU without AVX512-BF16 runs them, and
    the record of the flags they ran with; None (and a line saying why) where the kernel cannot run."""
    from dist_nce.kernels import build as native

    hide = "avx512_bf16" if "avx512_bf16" in native.cpu_flags() else ""
    saved = os.environ.get(native.MASK)
    os.environ[native.MASK] = hide
    try:
        reason = native.BLOCK_FP32.unavailable_reason()
    finally:
        _restore(native.MASK, saved)
    if reason is not None:
        print(f"AVX2 kernel rows left out: {reason}", flush=True)
        return None
    seen = sorted(f for f in native.cpu_flags() if f.startswith(("avx", "fma")) and f != hide)
    label = f"AVX2+FMA kernel, {hide} masked" if hide else "AVX2+FMA kernel"

    def masked(fn: Callable[[int], Any]) -> Callable[[int], Any]:
        """``fn`` with the mask in the environment for the call (the kernel checks read it per call)."""
        def run(j: int) -> Any:
            before = os.environ.get(native.MASK)
            os.environ[native.MASK] = hide
            try:
                return fn(j)
            finally:
                _restore(native.MASK, before)
        return run

    cfg = dict(backend="torch", sampler="block", block_rows=args.block_rows, chunk_rows=args.chunk_rows,
               kernel="native")
    fp32 = ShardIndex(DUAL, Reps(ents), 0, IndexConfig(**cfg))
    bf16 = ShardIndex(DUAL, Reps(ents), 0, IndexConfig(score_dtype="bf16", **cfg))
    methods = {
        f"gumbel: exact block fp32 ({label}), 1 process x 1 thread": ("gumbel", masked(lambda j: _Done(hard_negatives(
            fp32.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k))), args.calls, 1, 1),
        f"gumbel: exact block bf16 ({label}), 1 process x 1 thread": ("gumbel", masked(lambda j: _Done(hard_negatives(
            bf16.gumbel_topk(gq[j], k, ggold[j], 11, gkeys[j]), k))), args.calls, 1, 1),
        f"topk: exact fp32 ({label}), 1 process x 1 thread": ("topk", masked(lambda j: _Done(
            fp32.topk(queries[j], k, gold[j]))), args.calls, 1, 1),
    }
    record = {"isa": native.AVX2_FMA.name, "needs": list(native.AVX2_FMA.flags), "cflags": list(native.AVX2_FMA.cflags),
              "masked": hide or None, "cpu_avx_flags_visible": seen, "rows": list(methods)}
    print(f"AVX2 kernel rows: {label} (flags visible: {' '.join(seen)}; built with "
          f"{' '.join(f for f in native.AVX2_FMA.cflags if f.startswith('-m'))})", flush=True)
    return {"methods": methods, "record": record}


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


if __name__ == "__main__":
    main()
