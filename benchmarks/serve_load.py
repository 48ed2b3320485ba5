"""Serving under load: the linker's Serve app through its HTTP edge at 1, 50 and 200 concurrent clients,
beside the same requests through the Python API (``Linker.link``).

Every client sends its well-formed requests one after another on one keep-alive connection, all
clients at once; a request is one KILT dev input (one mention, k = --k). Per level: answered
requests per second, latency percentiles (p50/p95/p99) of the answered ones, and the share shed
with 503 (the edge's deadline, ``request_timeout_s`` from arrival; 504s are counted too), and once
more at the highest level with clients that ask for a --tight deadline (X-Request-Timeout-Seconds),
which the app cannot meet for all of them: what it sheds, and how fast. The
Python API links the same requests one at a time in this process: the cost of one request with
no HTTP, no Ray and no queue. Levels are interleaved over --repeats rounds and stored as
min / median / max. Writes benchmarks/results/serve_load.json; ``python -m benchmarks.report``
renders it into docs/benchmarks.md and docs/linking.md.

    .venv/bin/python -m benchmarks.serve_load                      # a tiny exported run built here
    .venv/bin/python -m benchmarks.serve_load --run runs/demo/<time>
    .venv/bin/python -m benchmarks.serve_load --quick --force      # 1 and 4 clients, one round: seconds
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from benchmarks.common import add_hygiene_args, load_guard, machine_info, print_table, save_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="run directory (default: a tiny exported run built in a temporary directory)")
    ap.add_argument("--clients", default="1,50,200", help="concurrency levels, comma-separated")
    ap.add_argument("--per-client", type=int, default=5, help="requests each client sends")
    ap.add_argument("--min-requests", type=int, default=50, help="requests per level at least (more per client)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=15.0, help="request_timeout_s of the app (seconds)")
    ap.add_argument("--tight", type=float, default=2.0,
                    help="one more level at the highest concurrency whose clients ask for this deadline "
                         "(X-Request-Timeout-Seconds): what is shed; 0 = none")
    ap.add_argument("--quick", action="store_true", help="1 and 4 clients, 2 requests each, one round")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/serve_load.json)")
    add_hygiene_args(ap)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- load

def storm(port: int, path: str, bodies: list[bytes], clients: int, per_client: int,
          timeout_s: float = 120.0, deadline_s: float | None = None) -> tuple[list[tuple[int, float]], float]:
    """``clients`` threads start together, each sending ``per_client`` of ``bodies`` in turn on one
    keep-alive connection (a new one after the server closes it), asking for ``deadline_s`` if given.
    Returns ((status, seconds) per request, 0 for a failed connection; the wall time of the storm)."""
    headers = {"Content-Type": "application/json"}
    if deadline_s:
        headers["X-Request-Timeout-Seconds"] = str(deadline_s)
    results: list[tuple[int, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        start.wait()
        mine = []
        for j in range(per_client):
            body = bodies[(c * per_client + j) % len(bodies)]
            t0 = time.perf_counter()
            try:
                conn.request("POST", path, body=body, headers=headers)
                r = conn.getresponse()
                r.read()
                status = r.status
                if r.getheader("connection", "").lower() == "close":
                    conn.close()
            except (OSError, http.client.HTTPException):
                status = 0
                conn.close()
            mine.append((status, time.perf_counter() - t0))
        conn.close()
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(results: list[tuple[int, float]], wall_s: float) -> dict:
    """One storm: answered per second, latency percentiles of the answered, shares shed (503) and late (504)."""
    ok = [t for s, t in results if s == 200]
    n = len(results)
    return {"requests": n, "ok": len(ok), "wall_s": wall_s, "ok_per_s": len(ok) / wall_s,
            "p50_s": percentile(ok, 50), "p95_s": percentile(ok, 95), "p99_s": percentile(ok, 99),
            "shed": sum(s == 503 for s, _ in results) / n, "late": sum(s == 504 for s, _ in results) / n,
            "failed": sum(s not in (200, 503, 504) for s, _ in results) / n,
            "max_s": max(t for _, t in results)}


def spread_of(rounds: list[dict], key: str) -> dict | None:
    values = [r[key] for r in rounds if r[key] is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def python_api(link: Callable[[dict], object], requests: list[dict]) -> tuple[list[tuple[int, float]], float]:
    """The same requests through ``link`` (Linker.link), one at a time: (200, seconds) each, and the wall time."""
    out = []
    t0 = time.perf_counter()
    for body in requests:
        t = time.perf_counter()
        link(body)
        out.append((200, time.perf_counter() - t))
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- the app

def start_app(run: Path, k: int, deadline: float) -> tuple[int, str]:
    """A loopback Ray, Serve with its proxy off, and the app with an edge: (edge port, path)."""
    from ray import serve

    from dist_nce.cluster.runtime import free_port, init_ray
    from dist_nce.link.serve import build_app

    init_ray(num_cpus=2)
    port = free_port()
    serve.start(proxy_location="Disabled")
    serve.run(build_app({"run": str(run), "link": {"k": k}, "replica_cpus": 0, "edge_port": port, "route": "/link",
                         "request_timeout_s": deadline, "max_connections": 1024}), name="load", route_prefix=None)
    return port, "/link"


def dev_requests(dev: Path, k: int) -> list[dict]:
    lines = [json.loads(line) for line in open(dev, encoding="utf-8") if line.strip()]
    return [{"docs": [{"input": line["input"]}], "k": k} for line in lines]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = load_guard(args.force)
    if args.quick:
        args.clients, args.per_client, args.min_requests, args.repeats, args.tight = "1,4", 2, 2, 1, 0.5
    levels = [int(c) for c in args.clients.split(",")]
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.link import Linker

    configure_process(1)
    tmp = tempfile.TemporaryDirectory(prefix="bench_serve_load_")
    if args.run:
        run = Path(args.run)
        from benchmarks.link import dev_file

        dev = dev_file(run)
    else:
        from dist_nce.core.models import make_tiny_bert
        from dist_nce.link.tiny_run import make_tiny_run

        run = make_tiny_run(Path(tmp.name) / "tiny", make_tiny_bert(Path(tmp.name) / "bert"))
        dev = run.parent / "data" / "synthetic" / "aidayago2-dev-kilt.jsonl"
    requests = dev_requests(dev, args.k)
    bodies = [json.dumps(r).encode() for r in requests]
    linker = Linker.from_pretrained(run, {"k": args.k, "progress": False})
    api_requests = [requests[i % len(requests)] for i in range(max(args.min_requests, args.per_client))]

    from ray import serve

    port, path = start_app(run, args.k, args.deadline)
    try:
        storm(port, path, bodies, 4, 2)  # warm-up: the replicas' first batches
        python_api(lambda r: linker.link(r["docs"]), api_requests[:4])
        runs = [(f"serve_{c}", c, None) for c in levels]
        if args.tight:
            runs.append((f"serve_{levels[-1]}_tight", levels[-1], args.tight))
        rounds: dict[str, list[dict]] = {"python_api": [], **{name: [] for name, _, _ in runs}}
        for _ in range(args.repeats):  # interleaved: load that comes and goes falls on every level
            rounds["python_api"].append(summary(*python_api(lambda r: linker.link(r["docs"]), api_requests)))
            for name, c, deadline in runs:
                per = max(args.per_client, -(-args.min_requests // c))
                rounds[name].append(summary(*storm(port, path, bodies, c, per, deadline_s=deadline)))
    finally:
        serve.shutdown()
        tmp.cleanup()
    rows = []
    for name, rs in rounds.items():
        row = {"way": name, "clients": 1 if name == "python_api" else int(name.split("_")[1]),
               "deadline_s": args.tight if name.endswith("_tight") else args.deadline,
               "requests": rs[0]["requests"], "rounds": rs}
        for key in ("ok_per_s", "p50_s", "p95_s", "p99_s", "shed", "late", "failed", "max_s"):
            row[key] = spread_of(rs, key)
        rows.append(row)
    print(f"run {run}: {linker.store.num_entities:,} entities, k={args.k}, deadline {args.deadline:g} s, "
          f"{args.repeats} rounds (medians)")
    flat = [{"way": r["way"], "requests": r["requests"],
             **{k: (r[k] or {}).get("median") for k in ("ok_per_s", "p50_s", "p95_s", "p99_s", "shed", "late")}}
            for r in rows]
    print_table(flat, [("way", "way", "<15s"), ("requests", "requests", ">8d"), ("ok_per_s", "answered/s", ">10.1f"),
                       ("p50_s", "p50 s", ">7.3f"), ("p95_s", "p95 s", ">7.3f"), ("p99_s", "p99 s", ">7.3f"),
                       ("shed", "shed 503", ">8.3f"), ("late", "late 504", ">8.3f")])
    path_out = save_results("serve_load", {**guard, "load_average_after": round(os.getloadavg()[0], 2),
                                           "args": vars(args), "run": str(run) if args.run else "tiny (built here)",
                                           "entities": linker.store.num_entities, "results": rows,
                                           "machine": machine_info()}, args.out)
    print(f"wrote {path_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
