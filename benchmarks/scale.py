"""KILT scale on one machine: 5.9M synthetic entities across S shard actors.

5,903,530 clustered synthetic entity vectors (the KILT knowledge source's size) x d=64 are
written as each shard's persisted version 0, generated one shard at a time in blocks (no
per-row Python), and S EntityShard actors of a real NegativeService reload them. Two passes,
each its own service over the same values (rounded to bf16 first with ``--exact bf16``):

- exact: Gumbel-top-k over every entity. ``--exact bf16`` (default): the shards hold bf16 rows
  (``index.score_dtype bf16``) and sample with the top-down block sampler, the native kernel
  where the CPU has AVX512-BF16 (``dist_nce/index/native``); ``--exact fp32``: the faiss flat
  index's fp32 rows, torch scoring;
- faiss flat: faiss top-N candidates (fp32, or fp16 with ``--dtype fp16``), then Gumbel within
  them plus the tail estimate.

Reported, per pass:

- build: vector generation + write, and service start until every shard serves (reload +
  index build, shards in parallel);
- memory per shard: RSS of each actor process (psutil), its peak (VmHWM), and RSS minus
  the RSS of an EMPTY shard process (same code, no vectors: the interpreter, torch,
  faiss, Ray), against the raw bytes of the shard's vectors in the dtype it holds
  (target <= 1.3x);
- mining time for 18,395 AIDA-train-size queries with K-1 = 63 negatives, each pass over
  all the queries by default (measured to the end); ``--exact-queries`` and
  ``--flat-budget-s`` cut a smoke run short and extrapolate linearly. Extrapolated figures
  are LABELLED in the table and JSON. Refuses to record above load average 1.5 unless --force.

The passes run one after the other (each holds every core), not interleaved: each is one
long measurement to the end rather than repeats. Queries are noisy copies of cluster
centres (the driver never holds the 5.9M vectors); each gets a random gold row, excluded as
in training. Prints tables and writes benchmarks/results/scale.json.

    .venv/bin/python -m benchmarks.scale                     # 5.9M x 64, 4 shards: ~10 minutes
    .venv/bin/python -m benchmarks.scale --entities 500000   # smaller
    .venv/bin/python -m benchmarks.scale --dtype fp16 --d 128
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import psutil
import torch


from benchmarks.common import (add_hygiene_args, clustered, load_guard, machine_info, print_table, process_memory, save_results,  # noqa: E402
                               unit_centres, vector_service)
from dist_nce.actors.config import ServiceConfig  # noqa: E402
from dist_nce.cluster.runtime import configure_process, init_ray  # noqa: E402
from dist_nce.index.config import IndexConfig  # noqa: E402

KILT_ENTITIES = 5_903_530
AIDA_TRAIN = 18_395


def empty_shard_memory(store: str, config: ServiceConfig, d: int, storage_dtype: str) -> dict:
    """Memory of a shard process holding no vectors: the per-process floor to subtract."""
    import ray

    from dist_nce.actors.shard import start_shard
    from dist_nce.modeling.retriever import RetrieverConfig

    with tempfile.TemporaryDirectory(prefix="dist-nce-empty-shard-") as root:
        # num_cpus=0: the serving shards hold every CPU Ray was given; this one only has to start.
        handle = start_shard(store, (0, 1), 0, 1, RetrieverConfig(preset="dual", storage_dtype=storage_dtype),
                             dataclasses.replace(config, num_cpus=0), root, d)
        status = ray.get(handle.status.remote())
        mem = process_memory(status["pid"])
        ray.kill(handle, no_restart=True)
    return mem


def run_queries(mine: Callable[[int], Any], batches: int, in_flight: int, budget_s: float | None) -> tuple[int, float]:
    """Submit batches 0, 1, ... keeping ``in_flight`` pending, until all are done or ``budget_s``
    passes; (batches answered, seconds)."""
    t0 = time.perf_counter()
    pending: collections.deque = collections.deque()
    done = submitted = 0
    while done < batches:
        over = budget_s is not None and time.perf_counter() - t0 > budget_s
        while not over and submitted < batches and len(pending) < in_flight:
            pending.append(mine(submitted))
            submitted += 1
        if not pending:
            break
        pending.popleft().result()
        done += 1
    return done, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entities", type=int, default=KILT_ENTITIES)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="vector storage (faiss Flat / SQfp16)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--queries", type=int, default=AIDA_TRAIN, help="queries to mine for (AIDA train)")
    ap.add_argument("--k", type=int, default=63, help="K-1 negatives")
    ap.add_argument("--batch", type=int, default=128, help="queries per mine() request")
    ap.add_argument("--in-flight", type=int, default=2, help="mine() requests kept in flight")
    ap.add_argument("--exact-queries", type=int, default=None,
                    help="queries timed in exact Gumbel mode (default: all of --queries, measured to the end)")
    ap.add_argument("--flat-budget-s", type=float, default=None, help="seconds of flat-mode mining before "
                    "extrapolating (default: none, measured to the end)")
    ap.add_argument("--exact", choices=["bf16", "fp32"], default="bf16",
                    help="the exact pass's shards: bf16 rows (index.score_dtype bf16; the native block kernel where "
                         "it runs) or the faiss flat index's own rows (--dtype)")
    ap.add_argument("--sampler", choices=["dense", "block"], default="block",
                    help="exact Gumbel sampler (index.sampler); block: the top-down sampler, shards on its grid")
    ap.add_argument("--block-rows", type=int, default=128, help="index.block_rows of the block sampler")
    ap.add_argument("--candidates", type=int, default=1024, help="flat mode: faiss top-N before Gumbel")
    ap.add_argument("--workdir", default=None, help="where vectors are persisted (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (reuse it with --workdir next time)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/scale.json)")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    n, d, S, B = args.entities, args.d, args.shards, args.batch
    configure_process(threads=1)
    itemsize = 4 if args.dtype == "fp32" else 2
    raw = n * d * itemsize
    need = 1.3 * raw + S * 600 * 2 ** 20  # build peak (index/load.py: one copy) plus the processes' floor
    avail = psutil.virtual_memory().available
    guard = load_guard(args.force)
    load_before = guard["load_average_before"]
    print(f"{n:,} x {d} {args.dtype} = {raw / 2 ** 30:.2f} GiB over {S} shards; {avail / 2 ** 30:.1f} GiB "
          f"available; load average {load_before:.1f} on {os.cpu_count()} cores", flush=True)
    if avail < need:
        sys.exit(f"scale.py: needs about {need / 2 ** 30:.1f} GiB free, {avail / 2 ** 30:.1f} GiB available; "
                 "use --entities to run smaller")

    storage_dtype = {"fp32": "float32", "fp16": "float16"}[args.dtype]
    clusters = max(16, n // 500)
    centres = unit_centres(clusters, d, seed=0)
    root = args.workdir or tempfile.mkdtemp(prefix="dist-nce-scale-")
    reuse = args.workdir is not None
    init_ray(num_cpus=os.cpu_count())
    gen_s = [0.0]

    def shard_vectors(i: int, a: int, b: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = clustered(b - a, d, clusters, seed=1000 + i, scale=4.0, centres=centres)
        if args.exact == "bf16":  # both passes score the same values: the bf16 rows the exact pass holds
            out = out.bfloat16().float()
        gen_s[0] += time.perf_counter() - t0
        return out

    # The exact pass: bf16 rows (index.score_dtype bf16, the native block kernel where it runs), or the
    # faiss flat fp32 rows (--exact fp32). The faiss pass: faiss flat top-N + Gumbel within + tail estimate.
    exact_index = (IndexConfig(backend="torch", score_dtype="bf16", gumbel="exact", sampler=args.sampler,
                               block_rows=args.block_rows) if args.exact == "bf16" else
                   IndexConfig(backend="flat", storage=args.dtype, gumbel="exact", sampler=args.sampler,
                               block_rows=args.block_rows))
    flat_index = IndexConfig(backend="flat", storage=args.dtype, gumbel="candidates", candidates=args.candidates,
                             tail_sample=1024, sampler=args.sampler, block_rows=args.block_rows)
    passes = [(f"exact Gumbel ({args.sampler} sampler, {args.exact})", exact_index,
               "bfloat16" if args.exact == "bf16" else storage_dtype),
              (f"faiss flat (top-{args.candidates} + Gumbel)", flat_index, storage_dtype)]

    # ---- queries: noisy cluster centres, a random gold row each
    g = torch.Generator().manual_seed(7)
    batches = -(-args.queries // B)
    q = centres[torch.randint(0, clusters, (batches * B,), generator=g)]
    q = 4.0 * torch.nn.functional.normalize(q + 0.5 / d ** 0.5 * torch.randn(q.shape, generator=g), dim=1)
    q = q.view(batches, B, d)
    gold = torch.randint(0, n, (batches, B), generator=g)
    qkeys = torch.arange(batches * B).view(batches, B)

    def miner(svc) -> Callable[[int], Any]:
        return lambda j: svc.mine(q[j], gold[j], args.k, 0, 3, qkeys[j])

    mine_rows, mem_rows, floors, write_s = [], [], {}, {}
    exact_batches = min(batches, max(1, -(-(args.exact_queries or args.queries) // B)))
    for mode, index, dtype in passes:
        cfg = ServiceConfig(num_shards=S, num_cpus=os.cpu_count() / S, threads=1, max_concurrency=4, index=index)
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        t0, gen_before = time.perf_counter(), gen_s[0]
        service, start_s = vector_service(os.path.join(root, dtype), n, d, shard_vectors, cfg, storage_dtype=dtype,
                                          reuse=reuse)
        write_s[mode] = time.perf_counter() - t0 - start_s
        print(f"{mode}: vectors generated in {gen_s[0] - gen_before:.1f} s, generated + written in "
              f"{write_s[mode]:.1f} s; serving after {start_s:.1f} s", flush=True)
        # ---- memory per shard, against the bytes of its rows in the dtype it holds
        floor = floors[mode] = empty_shard_memory(str(os.path.join(root, dtype, "store")), cfg, d, dtype)
        for status in service.status():
            a, b = status["rows"]
            mem = process_memory(status["pid"])
            shard_raw = (b - a) * d * itemsize / 2 ** 20
            extra = mem["rss_mib"] - floor["rss_mib"]
            mem_rows.append({"mode": mode, "dtype": dtype, "shard": status["shard"], "rows": f"[{a:,}, {b:,})",
                             "raw_mib": shard_raw, **mem, "empty_shard_rss_mib": floor["rss_mib"],
                             "rss_minus_empty_mib": extra, "ratio_rss_minus_empty": extra / shard_raw,
                             "ratio_rss": mem["rss_mib"] / shard_raw,
                             "ratio_peak_minus_empty": (mem["peak_rss_mib"] - floor["rss_mib"]) / shard_raw
                             if mem["peak_rss_mib"] else None})
        exact_mode = index is exact_index
        run_queries(miner(service), 1, 1, None)  # warm-up
        done, seconds = run_queries(miner(service), exact_batches if exact_mode else batches, args.in_flight,
                                    None if exact_mode else args.flat_budget_s)
        measured = done * B
        per_query = seconds / measured
        row = {"mode": mode, "queries_measured": measured, "seconds_measured": seconds, "qps": 1 / per_query,
               "queries": args.queries, "minutes_for_all": per_query * args.queries / 60,
               "extrapolated": measured < args.queries, "service_start_s": start_s, "dtype": dtype,
               "label": f"extrapolated from {measured:,} queries" if measured < args.queries else "measured"}
        if not exact_mode:
            trunc = service.mine(q[0], gold[0], args.k, 0, 3, qkeys[0]).result().truncation
            row["truncation_mean"] = float(trunc.mean()) if trunc is not None else None
        mine_rows.append(row)
        print(f"{mode}: {measured:,} queries in {seconds:.1f} s", flush=True)
        service.shutdown()
    for row in mine_rows:
        row["x_exact"] = mine_rows[0]["minutes_for_all"] / row["minutes_for_all"]
    floor = floors[passes[0][0]]

    print(f"\n{n:,} entities x {d} {args.dtype}, {S} shards x 1 thread; load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; empty shard process: {floor['rss_mib']:.0f} MiB RSS")
    print_table(mem_rows, [("mode", "service", "<34s"), ("shard", "shard", ">5d"), ("rows", "rows", "<24s"), ("raw_mib", "raw MiB", ">8.0f"),
                           ("rss_mib", "RSS MiB", ">8.0f"), ("peak_rss_mib", "peak MiB", ">8.0f"),
                           ("rss_minus_empty_mib", "RSS-empty", ">9.0f"),
                           ("ratio_rss_minus_empty", "(RSS-empty)/raw", ">6.2f"),
                           ("ratio_peak_minus_empty", "(peak-empty)/raw", ">6.2f"), ("ratio_rss", "RSS/raw", ">6.2f")])
    print()
    print_table(mine_rows, [("mode", "mining mode", "<34s"), ("queries_measured", "timed q", ">8d"),
                            ("qps", "q/s", ">8.1f"), ("minutes_for_all", f"min for {args.queries:,} q", ">8.1f"),
                            ("x_exact", "x exact", ">7.1f"), ("service_start_s", "start s", ">7.1f"),
                            ("label", "", "<36s")])
    out = save_results("scale", {
        "benchmark": "scale", "entities": n, "d": d, "dtype": args.dtype, "shards": S, "k": args.k,
        "batch": B, "in_flight": args.in_flight, "sampler": args.sampler, "exact": args.exact,
        "block_rows": args.block_rows, "raw_bytes": raw, "vector_generation_s": gen_s[0],
        "vector_generate_and_write_s": write_s, "empty_shard_memory": floor, "empty_shard_memory_by_mode": floors,
        "memory": mem_rows,
        "mining": mine_rows, **guard,
        "machine": machine_info(threads_per_shard=1, load_average_before=load_before),
    }, args.out)
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
