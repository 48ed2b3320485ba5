"""Ingest throughput and peak memory: ``kb.prepare`` against a naive single-process loop.

    .venv/bin/python -m benchmarks.ingest                      # 1M synthetic KILT entities
    .venv/bin/python -m benchmarks.ingest --entities 20000 --baseline-entities 5000 --workers 1

The synthetic knowledge source (``kb.synthetic``, real KILT format) is generated once
into ``--data-dir`` and reused. Every measured run is a fresh subprocess, timed wall
clock from start to exit (interpreter start and tokenizer load included, for both), with
the resident memory of its whole process tree (parent + workers) sampled every 0.1 s.

The baseline reads line by line, tokenizes one entity at a time with the plain
tokenizer call (``tok(text, truncation=True, padding="max_length")``), keeps everything
in Python lists and writes one Arrow file at the end. At 1M entities it would take
about an hour here, so by default it runs on a prefix (``--baseline-entities``) and its
rate is compared per entity; the table says so.

Wall-clock rates depend on what else runs on the machine, so each run also reports
the CPU seconds of its process tree (``getrusage`` of waited-for children) and the mean
load average while it ran.

Results: a printed table and ``benchmarks/results/ingest.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_kilt(data_dir: Path, entities: int, seed: int) -> Path:
    """The synthetic knowledge source with ``entities`` lines (generated once, again when the
    size, seed or generator changed)."""
    from kb.synthetic.cache import ensure_kilt

    return ensure_kilt(data_dir, entities, 0, 0, 0, seed, progress=True, log=lambda m: print(m, flush=True))["kb"]


def _anon_bytes(pid: int) -> int:
    """Anonymous resident memory of ``pid`` (``RssAnon``): what the process allocated,
    without the file pages it has memory-mapped (those are page cache, reclaimable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds of the whole process tree, the mean 1-minute
    load average while it ran, and peak memory of the tree: RSS (includes memory-mapped
    file pages) and anonymous RSS (the memory the processes allocated), summed over the
    tree, plus the RSS of its largest process."""
    import resource

    import psutil

    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    loads = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak_tree = peak_single = peak_anon = 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
            peak_tree, peak_single = max(peak_tree, sum(rss)), max(peak_single, max(rss, default=0))
            peak_anon = max(peak_anon, sum(_anon_bytes(p.pid) for p in procs))
        except psutil.Error:
            pass
        loads.append(os.getloadavg()[0])
        time.sleep(0.1)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    # Waited-for descendants (pool workers joined by the job) are included in RUSAGE_CHILDREN.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - usage0.ru_utime) + (usage.ru_stime - usage0.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "load_avg_1m": round(sum(loads) / max(len(loads), 1), 2), "peak_rss_tree_mib": round(peak_tree / 2**20, 1),
            "peak_anon_tree_mib": round(peak_anon / 2**20, 1),
            "peak_rss_single_mib": round(peak_single / 2**20, 1), "stdout": out}


def naive_ingest(kb: Path, limit: int, out: Path, max_len: int, model_dir: str | None) -> None:
    """The baseline: one line, one tokenizer call at a time; everything in lists."""
    import pyarrow as pa

    from dist_nce.core.text import TITLE_SEP, load_tokenizer

    tok = load_tokenizer(model_dir)
    source_ids, titles, ids = [], [], []
    with open(kb, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if n >= limit:
                break
            page = json.loads(line)
            title = page["wikipedia_title"]
            description = " ".join(p.strip() for p in page["text"][1:] if p.strip())
            enc = tok(f"{title} {TITLE_SEP} {description}", max_length=max_len, truncation=True,
                      padding="max_length")
            source_ids.append(page["wikipedia_id"])
            titles.append(title)
            ids.append(enc["input_ids"])
    table = pa.table({"source_id": source_ids, "title": titles,
                      "token_ids": pa.array(ids, pa.list_(pa.int32(), max_len))})
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def agreement(store_dir: Path, baseline_file: Path, rows: int) -> float:
    """Fraction of the first ``rows`` entities whose token ids are identical in both outputs."""
    import numpy as np
    import pyarrow as pa

    from kb.store import EntityStore

    base = pa.ipc.open_file(pa.memory_map(str(baseline_file))).read_all()
    n = min(rows, base.num_rows)
    ours = EntityStore(store_dir).token_ids(np.arange(n))
    theirs = np.array(base.column("token_ids").slice(0, n).to_pylist(), dtype=np.int32)
    return float((ours == theirs).all(axis=1).mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entities", type=int, default=1_000_000)
    ap.add_argument("--baseline-entities", type=int, default=100_000,
                    help="entities the naive baseline ingests (a prefix of the same file)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    ap.add_argument("--entity-max-len", type=int, default=128)
    ap.add_argument("--model-dir", default=None, help="tokenizer (default: the shipped MiniLM)")
    ap.add_argument("--chunk-size", default="32M")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="where the synthetic KB is cached "
                    "(default: $TMPDIR/dist-nce-bench/kilt-<entities>)")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "ingest.json"))
    ap.add_argument("--_baseline", nargs=3, metavar=("KB", "LIMIT", "OUT"), help=argparse.SUPPRESS)
    from benchmarks.common import add_hygiene_args, load_guard

    add_hygiene_args(ap)
    args = ap.parse_args(argv)

    if args._baseline:
        kb, limit, out = args._baseline
        naive_ingest(Path(kb), int(limit), Path(out), args.entity_max_len, args.model_dir)
        return 0

    data_dir = Path(args.data_dir or Path(tempfile.gettempdir()) / "dist-nce-bench" / f"kilt-{args.entities}")
    kb = synthetic_kilt(data_dir, args.entities, args.seed)
    work = data_dir / "runs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = ["--model-dir", args.model_dir] if args.model_dir else []
    env = {"TOKENIZERS_PARALLELISM": "false"}  # one core per process, in every run
    guard = load_guard(args.force)
    load = guard["load_average_before"]
    runs = []

    base_n = min(args.baseline_entities, args.entities)
    print(f"baseline: naive loop on the first {base_n:,} entities ...", flush=True)
    r = measure([sys.executable, "-m", "benchmarks.ingest", "--entity-max-len", str(args.entity_max_len), *model,
                 "--_baseline", str(kb), str(base_n), str(work / "baseline.arrow")], env)
    runs.append({"name": "naive baseline (1 process)", "workers": 1, "entities": base_n, **r})

    for w in args.workers:
        print(f"kb.prepare with {w} worker(s) on {args.entities:,} entities ...", flush=True)
        out = work / f"store-w{w}"
        r = measure([sys.executable, "-m", "kb.prepare", "--kilt-ks", str(kb), "--out", str(out),
                     "--workers", str(w), "--chunk-size", args.chunk_size, "--entity-max-len",
                     str(args.entity_max_len), "--no-progress", *model], env)
        runs.append({"name": f"kb.prepare ({w} worker{'s' if w > 1 else ''})", "workers": w,
                     "entities": args.entities, **r})

    for run in runs:
        run.pop("stdout")
        run["entities_per_s"] = round(run["entities"] / run["seconds"], 1)
        run["entities_per_cpu_s"] = round(run["entities"] / run["cpu_seconds"], 1)
        run["speedup_vs_baseline"] = round(run["entities_per_s"] / runs[0]["entities_per_s"], 2)
    same = agreement(work / f"store-w{args.workers[0]}", work / "baseline.arrow", min(base_n, 20_000))
    result = {
        "entities": args.entities, "kb_bytes": kb.stat().st_size, "baseline_entities": base_n,
        "entity_max_len": args.entity_max_len, "model_dir": args.model_dir or "default (MiniLM)",
        "chunk_size": args.chunk_size, "token_agreement_with_baseline": same,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": round(load, 2),
                    "python": platform.python_version()},
        "runs": runs, **guard,
    }
    header = (f"{'run':<28}{'entities':>10}{'wall s':>9}{'ent/s':>8}{'x base':>8}{'CPU s':>9}{'ent/CPU s':>10}"
              f"{'load':>6}{'tree RSS':>11}{'tree anon':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    for run in runs:
        print(f"{run['name']:<28}{run['entities']:>10,}{run['seconds']:>9.1f}{run['entities_per_s']:>8.0f}"
              f"{run['speedup_vs_baseline']:>8.2f}{run['cpu_seconds']:>9.1f}{run['entities_per_cpu_s']:>10.0f}"
              f"{run['load_avg_1m']:>6.1f}{run['peak_rss_tree_mib']:>8.0f}MiB{run['peak_anon_tree_mib']:>8.0f}MiB")
    if base_n < args.entities:
        print(f"(the baseline ran on the first {base_n:,} of {args.entities:,} entities; rates compare per entity)")
    print(f"token ids identical to the baseline's on {100 * same:.2f}% of the first {min(base_n, 20_000):,} "
          f"entities; {os.cpu_count()} cores; 'load' is the mean 1-minute load average during the run "
          "(other processes share the machine: ent/CPU s is the contention-free rate); 'tree RSS' includes "
          "memory-mapped Arrow pages, 'tree anon' is allocated memory only")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.json}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
