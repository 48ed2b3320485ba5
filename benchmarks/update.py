"""KB deltas against a full rebuild: add 1% new entities and remove 1% of a KB, live.

On synthetic KILT knowledge sources of each size in ``--entities`` (1M is the target size,
100k beside it shows what grows with the KB; run it only on an idle machine), in ONE run,
each size interleaved over ``--repeats`` rounds:

1. delta: ``kb.delta.update`` (tokenize the added pages, write KB version 1: appended rows,
   tombstones, the added ids' index, then the manifest) in a child process, then
   ``NegativeService.apply_delta()`` on a RUNNING service (S shard actors serving version 0):
   each shard encodes only the new rows placed on it and swaps in the new version. Timed
   from the start of the update until every shard serves the new version.
2. rebuild: ``kb.prepare`` of the final entity set from scratch (child process), then a new
   service encoding every row (``ensure_encoded``), until it serves version 0. The same
   final KB, built the way every anchor (BLINK, EntQA, ANCE) changes one entity.

Memory: the peak resident memory of the update child (its own ``VmHWM``, see
:func:`run_child`) against the prepare child's, and each shard's resident memory growth over the
delta (``uss``) against the vectors of the rows it added: both should follow the delta,
not the KB. Untimed set-up per round: a fresh copy of the version-0 store and of the
shards' persisted version 0, a service started on them and ready (its reloaded shards
hold the encoder of the weights they serve, as a running service's do; that one-time
cost per shard actor is recorded as ``encoder_ready_seconds`` and ``shard_uss_ready_mib``).

The encoder is a random tiny BERT (``--model tiny``, default: the cost shape of the
pipeline without hours of MiniLM encoding on 2 CPUs) or the shipped MiniLM (``--model
minilm``). Prints a table and writes benchmarks/results/update.json.

    .venv/bin/python -m benchmarks.update --repeats 2      # 100k and 1M, the target size (idle machine)
    .venv/bin/python -m benchmarks.update --entities 2000 5000 --repeats 1 --force --out /tmp/u.json  # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


from benchmarks.common import (add_hygiene_args, compare, interleaved, load_guard, machine_info,  # noqa: E402
                               print_table, process_memory, save_results)

ROOT = Path(__file__).resolve().parents[1]


def model_dir(kind: str, data_dir: Path) -> str:
    if kind == "minilm":
        from dist_nce.core.models import default_model_dir

        return default_model_dir()
    from dist_nce.core.models import make_tiny_bert

    out = data_dir / "tiny_bert"
    return str(out) if (out / "config.json").exists() else make_tiny_bert(out)


def write_sources(data_dir: Path, entities: int, add_frac: float, remove_frac: float, seed: int) -> dict:
    """Base source (first ``entities`` lines), added pages, removed ids, final source: files in
    the KILT format, cut from one synthetic source of entities + added lines."""
    from kb.synthetic.cache import ensure_kilt

    n_add, n_remove = max(1, round(entities * add_frac)), max(1, round(entities * remove_frac))
    src = ensure_kilt(data_dir / "synthetic", entities + n_add, 0, 0, 0, seed, log=lambda m: print(m, flush=True))["kb"]
    paths = {k: data_dir / f for k, f in (("base", "base.json"), ("add", "add.json"), ("remove", "remove.txt"),
                                          ("final", "final.json"))}
    stamp = data_dir / "sources.json"
    want = {"entities": entities, "n_add": n_add, "n_remove": n_remove, "seed": seed,
            "source_size": src.stat().st_size}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return {**{k: str(p) for k, p in paths.items()}, **want}
    step = entities // n_remove
    removed = set(range(0, step * n_remove, step))  # every step-th base line
    with open(src, encoding="utf-8") as f, open(paths["base"], "w") as base, open(paths["add"], "w") as add, \
            open(paths["final"], "w") as final, open(paths["remove"], "w") as rm:
        for i, line in enumerate(f):
            if i < entities:
                base.write(line)
                if i in removed:
                    rm.write(json.loads(line)["wikipedia_id"] + "\n")
                else:
                    final.write(line)
            else:
                add.write(line)
                final.write(line)
    stamp.write_text(json.dumps(want))
    return {**{k: str(p) for k, p in paths.items()}, **want}


# Runs ``python -m MODULE ARGS`` and writes the process's own peak resident memory (VmHWM: that of
# the image exec'd, not the forking parent's) to BENCH_PEAK_FILE at exit.
_PEAK_WRAPPER = """import atexit, os, runpy, sys
def _peak():
    with open('/proc/self/status') as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith('VmHWM:'))
    with open(os.environ['BENCH_PEAK_FILE'], 'w') as out:
        out.write(str(kib))
atexit.register(_peak)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
"""


def run_child(args: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MiB) of ``python -m MODULE ...`` (``args``) run to completion as a
    child process. Not ``ru_maxrss`` from ``wait4``: Linux carries the forking parent's peak
    over the exec into it, so a small child would report this benchmark's own hundreds of MiB.
    Ingest worker processes (``--workers`` > 1) are not counted."""
    if args[0] != "-m":
        raise ValueError(f"run_child runs modules: -m MODULE ..., got {args[:2]}")
    peak_file = Path(tempfile.mkstemp(prefix="bench_peak_")[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "BENCH_PEAK_FILE": str(peak_file)}
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, *args[1:]], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args)}: exit status {proc.returncode}")
        return seconds, int(peak_file.read_text()) / 1024  # KiB
    finally:
        peak_file.unlink(missing_ok=True)


def prepare_args(source: str, out: Path, model: str, workers: int) -> list[str]:
    return ["-m", "kb.prepare", "--kilt-ks", source, "--out", str(out), "--model-dir", model, "--entity-max-len",
            "128", "--workers", str(workers), "--no-progress"]


class Bench:
    """The state each timed method starts from, set up untimed before every call."""

    def __init__(self, args, sources: dict, model: str, work: Path, state: dict):
        from dist_nce.actors.config import ServiceConfig
        from dist_nce.index.config import IndexConfig
        from dist_nce.modeling.retriever import RetrieverConfig

        self.args, self.sources, self.model, self.work, self.state = args, sources, model, work, state
        self.config = ServiceConfig(num_shards=args.shards, num_cpus=0.5, encode_batch_size=args.batch,
                                    encode_dtype="fp32", keep_versions=2, index=IndexConfig(backend="flat"))
        self.retriever = RetrieverConfig(preset="dual", mention_model=model, storage_dtype="float32")
        self.base_store, self.base_shards = work / "base_store", work / "base_run" / "shards"
        self.service = None
        self.records: dict[str, list] = {"delta": [], "rebuild": []}

    def build_base(self) -> float:
        """Version 0, once: the base store and every shard's persisted version 0 (untimed)."""
        from dist_nce.actors.service import NegativeService

        if not (self.base_store / "manifest.json").exists():
            run_child(prepare_args(self.sources["base"], self.base_store, self.model, self.args.workers))
        t0 = time.perf_counter()
        service = NegativeService.create(str(self.base_store), self.retriever, self.config, str(self.work / "base_run"))
        service.ensure_encoded(self.state)
        service.shutdown()
        return time.perf_counter() - t0

    def _stop(self) -> None:
        if self.service is not None:
            self.service.shutdown()
            self.service = None

    def setup_delta(self) -> None:
        from dist_nce.actors.service import NegativeService

        self._stop()
        store, run = self.work / "delta_store", self.work / "delta_run"
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(self.base_store, store)
        shutil.copytree(self.base_shards, run / "shards")
        self.service = NegativeService.create(str(store), self.retriever, self.config, str(run))
        start = {s["shard"]: process_memory(s["pid"])["uss_mib"] for s in self.service.status()}
        t0 = time.perf_counter()
        if self.service.ensure_encoded(self.state) != 0 or any(s["encodes"] for s in self.service.status()):
            raise RuntimeError("the copied shards did not reload version 0")
        # A running service: the reloaded shards have built the encoder of the weights they serve
        # (ensure_encoded starts that in the background). Its one-time cost is recorded, not timed.
        while any(s["encoder_held"] != s["encoder_fingerprint"] for s in self.service.status()):
            if time.perf_counter() - t0 > 600:
                raise RuntimeError(f"the reloaded shards never built their encoder: {self.service.status()}")
            time.sleep(0.05)
        status = self.service.status()
        self.ready = {"encoder_ready_seconds": time.perf_counter() - t0,
                      "shard_uss_ready_mib": [process_memory(s["pid"])["uss_mib"] - start[s["shard"]] for s in status]}

    def delta(self) -> None:
        store = self.work / "delta_store"
        before = {s["shard"]: process_memory(s["pid"])["uss_mib"] for s in self.service.status()}
        seconds, peak = run_child(["-m", "kb.delta", "--store", str(store), "--add", self.sources["add"], "--remove",
                                   self.sources["remove"], "--model-dir", self.model, "--no-progress",
                                   "--workers", str(self.args.workers)])
        version = self.service.apply_delta()
        status = self.service.status()
        if {s["served"] for s in status} != {version} or {s["kb_version"] for s in status} != {1}:
            raise RuntimeError(f"the delta is not served: {status}")
        growth = [process_memory(s["pid"])["uss_mib"] - before[s["shard"]] for s in status]
        added = [sum(b - a for a, b in s["pieces"][1:]) for s in status]
        self.records["delta"].append({"update_seconds": seconds, "update_peak_rss_mib": peak,
                                      "shard_uss_growth_mib": growth, "shard_rows_added": added,
                                      "live": self.service.live.num_live, **self.ready})

    def setup_rebuild(self) -> None:
        self._stop()
        shutil.rmtree(self.work / "rebuild_store", ignore_errors=True)
        shutil.rmtree(self.work / "rebuild_run", ignore_errors=True)

    def rebuild(self) -> None:
        from dist_nce.actors.service import NegativeService

        store = self.work / "rebuild_store"
        seconds, peak = run_child(prepare_args(self.sources["final"], store, self.model, self.args.workers))
        self.service = NegativeService.create(str(store), self.retriever, self.config, str(self.work / "rebuild_run"))
        self.service.ensure_encoded(self.state)
        self.records["rebuild"].append({"prepare_seconds": seconds, "prepare_peak_rss_mib": peak,
                                        "live": self.service.live.num_live})


def measure(args, entities: int, model: str, state: dict) -> dict:
    """One KB size: the base version built untimed, then delta and rebuild interleaved."""
    from dist_nce.index.encode import state_fingerprint

    data_dir = Path(args.data_dir) / f"n{entities}-s{args.seed}"
    data_dir.mkdir(parents=True, exist_ok=True)
    sources = write_sources(data_dir, entities, args.add_frac, args.remove_frac, args.seed)
    bench = Bench(args, sources, model, data_dir / "work", state)
    try:
        base_encode = bench.build_base()
        times = interleaved({"delta": bench.delta, "rebuild": bench.rebuild}, args.repeats, warmup=0,
                            before={"delta": bench.setup_delta, "rebuild": bench.setup_rebuild})
    finally:
        bench._stop()
    ratio = compare(times["rebuild"], times["delta"])
    rows = [{"method": "delta (update + apply_delta)", **{k: times["delta"][k] for k in ("min", "median", "max")},
             "peak": max(r["update_peak_rss_mib"] for r in bench.records["delta"])},
            {"method": "full rebuild (prepare + encode all)",
             **{k: times["rebuild"][k] for k in ("min", "median", "max")},
             "peak": max(r["prepare_peak_rss_mib"] for r in bench.records["rebuild"])}]
    print(f"{entities:,} entities, +{sources['n_add']:,} added, -{sources['n_remove']:,} removed, "
          f"{args.shards} shards, {args.model} encoder")
    print_table(rows, [("method", "method", "<36s"), ("min", "min s", ">9.2f"), ("median", "median s", ">9.2f"),
                       ("max", "max s", ">9.2f"), ("peak", "peak MiB (child)", ">16.0f")])
    print(f"rebuild / delta: x{ratio['x_median']:.1f} (spreads apart: {ratio['distinct']})", flush=True)
    return {"entities": entities, "added": sources["n_add"], "removed": sources["n_remove"],
            "model_fingerprint": state_fingerprint(state)[:16], "seconds": times, "rebuild_over_delta": ratio,
            "records": bench.records, "base_encode_seconds": base_encode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entities", type=int, nargs="+", default=[100_000, 1_000_000],
                    help="KB sizes, each measured in turn in this run (a second size shows whether the delta's "
                         "time and memory follow the KB or the delta)")
    ap.add_argument("--add-frac", type=float, default=0.01)
    ap.add_argument("--remove-frac", type=float, default=0.01)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="encode batch size of the shards")
    ap.add_argument("--workers", type=int, default=1, help="ingest processes of prepare and update")
    ap.add_argument("--model", choices=["tiny", "minilm"], default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=str(ROOT / "data" / "bench_update"))
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/update.json)")
    add_hygiene_args(ap)
    args = ap.parse_args()
    hygiene = load_guard(args.force)

    from dist_nce.cluster.runtime import configure_process, init_ray
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import EntityEncoder
    from dist_nce.modeling.scoring import ScoreSpec

    configure_process(1)
    model = model_dir(args.model, Path(args.data_dir))
    state = EntityEncoder(Encoder.from_pretrained(model), ScoreSpec.preset("dual")).state()
    init_ray(num_cpus=max(2, args.shards))
    try:
        sizes = [measure(args, n, model, state) for n in sorted(args.entities)]
    finally:
        import ray

        ray.shutdown()
    payload = {"benchmark": "update", "shards": args.shards, "encode_batch": args.batch, "model": args.model,
               "repeats": args.repeats, "add_frac": args.add_frac, "remove_frac": args.remove_frac,
               "sizes": sizes, **hygiene, "machine": machine_info(torch_threads=torch.get_num_threads())}
    print(f"wrote {save_results('update', payload, args.out)}")


if __name__ == "__main__":
    main()
