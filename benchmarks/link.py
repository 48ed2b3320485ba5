"""Linking throughput: mentions/s end to end (tokenize + encode + search [+ rerank]), three ways.

Same model, same KB, same mentions, in one run, interleaved and repeated (min/median/max):

- ``naive``:   the Python API one mention at a time (``Linker.link([doc])`` per mention), the baseline;
- ``batched``: the Python API with every mention in one call (encoder batches of ``--batch-size``);
- ``serve``:   the Ray Serve app over HTTP on loopback, one mention per request, ``--clients``
               concurrent client threads (the encoder batches concurrent requests, ``@serve.batch``).

The mentions are the run's dev mentions (KILT inputs of the synthetic AIDA dev file), repeated
to ``--mentions``. Prints a table and writes benchmarks/results/link.json.

    .venv/bin/python -m benchmarks.link --run runs/demo/<time>          # the demo's MiniLM model
    .venv/bin/python -m benchmarks.link --quick                          # tiny random BERT, seconds
    .venv/bin/python -m benchmarks.link --run runs/demo/<time> --reranker runs/rr/model --no-serve
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


from benchmarks.common import add_hygiene_args, load_guard, machine_info, print_table, save_results  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="run directory (default: a tiny exported run built in a temporary directory)")
    ap.add_argument("--dev", help="KILT AIDA file whose inputs are linked (default: the run's dev file)")
    ap.add_argument("--mentions", type=int, default=256, help="mentions per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients (serve)")
    ap.add_argument("--reranker", help="reranker directory (all three ways rerank)")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="skip the Ray Serve measurement")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of this process")
    ap.add_argument("--quick", action="store_true", help="tiny model and KB, 24 mentions, 2 repeats")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/link.json)")
    add_hygiene_args(ap)
    return ap.parse_args(argv)


def dev_docs(path: Path, n: int) -> list[dict]:
    lines = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [{"input": lines[i % len(lines)]["input"]} for i in range(n)]


def dev_file(run: Path) -> Path:
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    data = summary["config"]["data"]
    candidates = [Path(data.get("aida_dir") or ""), Path(data.get("synthetic_dir") or "")]
    for d in candidates:
        if (d / "aidayago2-dev-kilt.jsonl").is_file():
            return d / "aidayago2-dev-kilt.jsonl"
    raise FileNotFoundError(f"{run}: no aidayago2-dev-kilt.jsonl under the run's data dirs; pass --dev")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = load_guard(args.force)
    if args.quick:
        args.mentions, args.repeats, args.k = min(args.mentions, 24), min(args.repeats, 2), min(args.k, 5)
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.link import Linker

    configure_process(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="bench_link_")
    if args.run:
        run = Path(args.run)
        dev = Path(args.dev) if args.dev else dev_file(run)
    else:
        from dist_nce.core.models import make_tiny_bert
        from dist_nce.link.tiny_run import make_tiny_run

        run = make_tiny_run(Path(tmp.name) / "tiny", make_tiny_bert(Path(tmp.name) / "bert"))
        dev = Path(args.dev) if args.dev else run.parent / "data" / "synthetic" / "aidayago2-dev-kilt.jsonl"
    docs = dev_docs(dev, args.mentions)
    link = {"k": args.k, "batch_size": args.batch_size, "progress": False, "reranker": args.reranker}
    linker = Linker.from_pretrained(run, link)

    def naive() -> list:
        return [linker.link([d])[0] for d in docs]

    def batched() -> list:
        return linker.link(docs)

    ways = {"naive": naive, "batched": batched}
    url = None
    if args.serve:
        from ray import serve

        from dist_nce.cluster.runtime import free_port, init_ray
        from dist_nce.link.serve import build_app, start_local

        init_ray(num_cpus=2)
        port = free_port()
        start_local(port)
        serve.run(build_app({"run": str(run), "link": link, "replica_cpus": 0.5, "max_batch_size": 32}),
                  name="link_bench", route_prefix="/link")
        url = f"http://127.0.0.1:{port}/link"
        pool = ThreadPoolExecutor(args.clients)

        def served() -> list:
            return [r["docs"][0] for r in pool.map(lambda d: post(url, {"docs": [d]}), docs)]

        ways["serve"] = served
    try:
        reference = [m["entities"][0]["row"] for d in batched() for m in d["mentions"]]  # also the warm-up
        times: dict[str, list[float]] = {w: [] for w in ways}
        agree: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, fn in ways.items():  # interleaved: a load change on the shared machine hits every way
                t0 = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - t0)
                top1 = [m["entities"][0]["row"] for d in out for m in d["mentions"]]
                agree[name] = sum(a == b for a, b in zip(top1, reference)) / len(reference)
    finally:
        if url is not None:
            pool.shutdown()
            serve.shutdown()
    base = statistics.median(times["naive"])
    rows = []
    for name, ts in times.items():
        rates = sorted(args.mentions / t for t in ts)
        rows.append({"way": name, "min": rates[0], "median": statistics.median(rates), "max": rates[-1],
                     "speedup": base / statistics.median(ts), "top1_agree": agree[name]})
    print(f"run {run}: {linker.store.num_entities:,} entities, {args.mentions} mentions x {args.repeats} repeats, "
          f"k={args.k}" + (f", reranker {args.reranker}" if args.reranker else ""))
    print_table(rows, [("way", "way", "<8s"), ("min", "mentions/s min", ">14.1f"),
                       ("median", "median", ">9.1f"), ("max", "max", ">9.1f"),
                       ("speedup", "x naive", ">8.2f"), ("top1_agree", "top-1 = batched", ">15.3f")])
    path = save_results("link", {**guard, "args": vars(args), "run": str(run), "entities": linker.store.num_entities,
                                 "seconds": times, "results": rows, "machine": machine_info()}, args.out)
    print(f"wrote {path}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
