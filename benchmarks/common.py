"""What the benchmarks share: timing, the machine's GEMM peak, machine info, JSON, tables,
synthetic vectors, and a real NegativeService over synthetic vectors.

Hygiene (issue 12): every benchmark calls :func:`load_guard` before timing anything: above
a 1-minute load average of 1.5 it refuses to record unless ``--force``, which marks the JSON
``"noisy": true``. Methods and their baseline are timed interleaved (A B A B ...,
:func:`interleaved`) and stored as min / median / max; :func:`compare` calls a difference
only when the spreads do not overlap. Benchmarks run as modules from the repository root
(``.venv/bin/python -m benchmarks.mining``), so they import this one as ``benchmarks.common``.
What only the GPU benchmarks need (device sync, the bf16 peak, the profiler) is in
:mod:`benchmarks.gpu_common`. Nothing here imports tests/: the GPU machine does not have it.
"""
from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- timing


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """(median seconds of ``repeats`` calls after ``warmup`` untimed ones, the last output)."""
    out = None
    for _ in range(warmup):  # allocator, lazy kernels, BLAS thread start
        out = fn()
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def gemm_gflops(threads: int, size: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 10) -> float:
    """This machine's GEMM rate: GFLOP/s of ``torch.mm`` of two [size, size] matrices on ``threads``
    threads (2 size^3 FLOPs per product), from the fastest of ``repeats`` products after two
    warm-ups: a peak, so a slow sample (a descheduled thread, a clock step) does not lower the
    bar that achieved rates are read against. The process's thread count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=g).to(dtype), torch.randn(size, size, generator=g).to(dtype)
        for _ in range(2):
            torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * size ** 3 / best / 1e9


def native_bf16() -> bool:
    """Whether this CPU has bf16 units torch uses (AVX512-BF16 / AMX): without them a bf16 GEMM
    is emulated, ~100x slower than fp32 (this project's 2-core AMD EPYC: AVX2 only), ~4x on AVX512
    without BF16. The shards' ``encode_dtype: auto`` asks the same function."""
    from dist_nce.index.encode import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def gemm_peaks(threads: int, *earlier: dict) -> dict:
    """fp32 and bf16 GEMM rates (GFLOP/s) on ``threads`` threads, measured now (best of 10 products):
    the peaks a benchmark's achieved GFLOP/s is read against. bf16 is measured at 2048^2 where
    the CPU has bf16 units and at 512^2 where it is emulated (2048^2 would take minutes, so 3
    products there). ``earlier``: peaks measured before in the same run (e.g. at its start);
    the result keeps the highest of each, so a run can measure before and after its work."""
    fast = native_bf16()
    now = {"fp32": gemm_gflops(threads), "bf16": gemm_gflops(threads, 2048 if fast else 512, torch.bfloat16,
                                                             10 if fast else 3)}
    return {**{k: max([now[k], *(e[k] for e in earlier)]) for k in now}, "bf16_native": fast, "threads": threads,
            "method": "best of 10 products" + (", highest of the measurements at the start and end" if earlier
                                              else "")}


# --------------------------------------------------------------------------- hygiene: load, interleaving, spread

LOAD_LIMIT = 1.5  # 1-minute load average above which a run is not recorded (2 cores here)


def add_hygiene_args(ap: Any) -> None:
    """``--force``: run and record even when the machine is busy (the JSON is then marked noisy)."""
    ap.add_argument("--force", action="store_true",
                    help=f"record even if the 1-minute load average exceeds {LOAD_LIMIT} before the start "
                         "(the JSON is marked \"noisy\": true)")


def load_guard(force: bool, limit: float = LOAD_LIMIT, load: float | None = None) -> dict:
    """Check the machine is idle enough to measure; call before any timing.

    Returns the record every result JSON carries (``**load_guard(...)``): the 1-minute load
    average before the start, the limit, and ``noisy`` (True when above the limit). Above
    the limit without ``force`` it refuses: SystemExit with the reason, nothing recorded.
    """
    load = os.getloadavg()[0] if load is None else float(load)
    noisy = load > limit
    if noisy and not force:
        raise SystemExit(f"load average {load:.2f} > {limit} on {os.cpu_count()} cores: other jobs would be "
                         "measured too, refusing to record. Wait for an idle machine, or pass --force to record "
                         "a run marked \"noisy\": true.")
    if noisy:
        print(f"WARNING: load average {load:.2f} > {limit}: recording a NOISY run (marked in the JSON); its "
              "figures are not comparable with an idle run's", flush=True)
    return {"load_average_before": round(load, 2), "load_limit": limit, "noisy": noisy}


def spread(seconds: Sequence[float]) -> dict:
    """min / median / max of repeated timings (seconds)."""
    return {"min": min(seconds), "median": statistics.median(seconds), "max": max(seconds),
            "repeats": len(seconds), "seconds": list(seconds)}


def interleaved(methods: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1,
                before: dict[str, Callable[[], None]] | None = None) -> dict[str, dict]:
    """Time every method ``repeats`` times interleaved (A B C A B C ...) after ``warmup``
    untimed rounds, so load that comes and goes falls on every method alike.

    ``before[name]()`` runs untimed before each call of ``name`` (e.g. set thread counts).
    Returns name -> :func:`spread` of the per-call seconds.
    """
    before = before or {}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rnd in range(warmup + repeats):
        for name, fn in methods.items():
            if name in before:
                before[name]()
            t0 = time.perf_counter()
            fn()
            if rnd >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: spread(t) for name, t in times.items()}


def compare(method: dict, baseline: dict) -> dict:
    """Cost of ``method`` relative to ``baseline`` (two :func:`spread` records of the same work):
    ratio of medians, the range of ratios their spreads allow, and whether the spreads are
    apart (a difference is called only then)."""
    return {"x_median": method["median"] / baseline["median"],
            "x_low": method["min"] / baseline["max"], "x_high": method["max"] / baseline["min"],
            "distinct": method["min"] > baseline["max"] or method["max"] < baseline["min"]}


# --------------------------------------------------------------------------- reporting


def machine_info(**extra: Any) -> dict:
    """CPU count, RAM, library versions, threads and load average, for the JSON of a run."""
    import psutil

    info = {"machine": platform.machine(), "processor": platform.processor() or platform.uname().machine,
            "cpu_count": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
            "available_ram_gib": round(psutil.virtual_memory().available / 2 ** 30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}
    for name in ("faiss", "ray", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:  # pragma: no cover - all are project dependencies
            info[name] = None
    info.update(extra)
    return info


def save_results(name: str, payload: dict, path: str | os.PathLike | None = None) -> Path:
    """Write ``payload`` atomically to ``path`` or benchmarks/results/<name>.json; return the path."""
    from dist_nce.core.artifacts import atomic_write_json

    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, payload)
    return out


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
    """Print ``rows`` under ``columns`` = (key, header, format spec such as ">9.1f" or "<30s");
    a missing or None value prints as '-'."""
    layout = []
    for _, header, spec in columns:
        align, width = re.match(r"([<>^]?)(\d*)", spec).groups()
        layout.append((align or ">") + str(max(int(width or 0), len(header))))
    print("  ".join(format(h, w) for (_, h, _), w in zip(columns, layout)))
    for row in rows:
        print("  ".join(format("-", w) if row.get(k) is None else format(format(row[k], s), w)
                        for (k, _, s), w in zip(columns, layout)))


# --------------------------------------------------------------------------- synthetic vectors


def clustered(n: int, d: int, clusters: int, seed: int, scale: float = 1.0, noise: float = 0.5,
              block_rows: int = 1 << 18, centres: torch.Tensor | None = None) -> torch.Tensor:
    """[n, d] float32 vectors of norm ``scale`` around ``clusters`` random unit centres.

    Clustered, not iid: approximate indexes and hard negatives need structure. Generated
    ``block_rows`` at a time (no per-row Python), so millions of rows cost one pass.
    ``centres`` [clusters, d] lets several calls (shards, queries) share one geometry.
    """
    g = torch.Generator().manual_seed(seed)
    if centres is None:
        centres = torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1)
    out = torch.empty((n, d), dtype=torch.float32)
    for a in range(0, n, block_rows):
        b = min(a + block_rows, n)
        x = centres[torch.randint(0, centres.shape[0], (b - a,), generator=g)]
        x += noise / d ** 0.5 * torch.randn(b - a, d, generator=g)
        out[a:b] = scale * torch.nn.functional.normalize(x, dim=1)
    return out


def unit_centres(clusters: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1)


# --------------------------------------------------------------------------- a service over synthetic vectors

VECTOR_STORE_TOKENIZER = "none: synthetic vectors, no text"


def write_vector_store(directory: str | os.PathLike, n: int, rows_per_part: int = 1 << 18) -> Path:
    """A prepared store of ``n`` text-less entity rows (one [CLS] token each), for services whose
    shards are handed vectors instead of encoding text. Arrow columns are built vectorised."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from dist_nce.core.artifacts import write_manifest
    from kb.store import ENTITIES_DIR, KIND, SCHEMA_VERSION, entity_schema, part_file, token_array, write_arrow

    directory = Path(directory)
    (directory / ENTITIES_DIR).mkdir(parents=True, exist_ok=True)
    schema, parts = entity_schema(1), []
    for i, a in enumerate(range(0, n, rows_per_part)):
        rows = np.arange(a, min(a + rows_per_part, n), dtype=np.int64)
        names = pc.cast(pa.array(rows), pa.string())
        table = pa.table({"row_id": rows, "source_id": names, "title": names,
                          "world": pa.nulls(len(rows), pa.string()), "line": rows + 1,
                          "length": np.ones(len(rows), np.int32),
                          "token_ids": token_array(np.full((len(rows), 1), 101, np.int32))}, schema=schema)
        write_arrow(directory / ENTITIES_DIR / part_file(i), table)
        parts.append(part_file(i))
    write_manifest(directory, KIND, SCHEMA_VERSION, entity_max_len=1, mention_max_len=1,
                   tokenizer_sha256=VECTOR_STORE_TOKENIZER, source={"synthetic_vectors": True},
                   entities={"count": n, "rows_per_part": rows_per_part, "parts": parts}, mentions={})
    return directory


def vector_service(root: str | os.PathLike, n: int, d: int, shard_vectors: Callable[[int, int, int], torch.Tensor],
                   config: Any, storage_dtype: str = "float32", reuse: bool = False) -> tuple[Any, float]:
    """A real NegativeService (dual score) whose shards serve synthetic vectors as version 0.

    ``shard_vectors(i, a, b)`` returns shard i's rows [a, b) as [b - a, d]; they are written
    as each shard's persisted version 0 (the format a shard writes after encoding), which
    the shards reload at start instead of encoding. ``config``: a ServiceConfig whose
    ``shard_dir`` is ignored (``<root>/shards``). ``reuse`` keeps vectors already written by
    an earlier call with the same root. Returns (service, seconds from create() until
    every shard serves version 0: reload + index build, in parallel).
    """
    import dataclasses

    from dist_nce.actors.service import NegativeService, even_ranges
    from dist_nce.actors.shard import EntityShard
    from dist_nce.modeling.retriever import RetrieverConfig
    from dist_nce.modeling.scoring import Reps

    root = Path(root)
    store = root / "store"
    from kb.store import EntityStore

    if not (reuse and (store / "manifest.json").exists() and EntityStore(str(store)).num_entities == n):
        write_vector_store(store, n)
    config = dataclasses.replace(config, shard_dir=str(root / "shards"))
    retriever = RetrieverConfig(preset="dual", storage_dtype=storage_dtype)
    threads = torch.get_num_threads()
    for i, (a, b) in enumerate(even_ranges(n, config.num_shards, config.index.row_grid())):
        # A plain (non-actor) EntityShard gives the exact persisted layout and identity the actor expects.
        shard = EntityShard(str(store), (a, b), i, config.num_shards, retriever, config, str(root / "shards"), d)
        if not (reuse and 0 in shard.versions.valid_versions()):
            vecs = shard_vectors(i, a, b).to(getattr(torch, storage_dtype))
            shard.versions.save(0, Reps(vecs), encoder_fingerprint="synthetic-vectors")
            del vecs
        del shard
    torch.set_num_threads(threads)  # EntityShard pinned this process to config.threads
    t0 = time.perf_counter()
    service = NegativeService.create(str(store), retriever, config, str(root), dim=d,
                                     tokenizer_sha256=VECTOR_STORE_TOKENIZER)
    if service.version() != 0:
        raise RuntimeError(f"shards did not reload the synthetic version 0: {service.status()}")
    return service, time.perf_counter() - t0


def process_memory(pid: int) -> dict:
    """Resident memory of process ``pid`` in MiB: rss now, peak (VmHWM), uss (private pages)."""
    import psutil

    proc = psutil.Process(pid)
    full = proc.memory_full_info()
    peak = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    except OSError:  # not Linux
        pass
    return {"rss_mib": full.rss / 2 ** 20, "uss_mib": full.uss / 2 ** 20, "peak_rss_mib": peak}


def som_kb(n: int, cols: int, dim: int, probe: int, seed: int = 0) -> tuple[Reps, Reps]:
    """Entity reps [n, cols, dim] with 8..cols real columns, probe mention reps [probe, cols, dim] with
    4..cols: SOM token reps for benchmarks.monitor and benchmarks.som_grid."""
    from dist_nce.modeling.scoring import Reps

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, cols + 1, (n,), generator=g)
    ents = Reps(torch.randn(n, cols, dim, generator=g), torch.arange(cols)[None, :] < lengths[:, None])
    q_len = torch.randint(4, cols + 1, (probe,), generator=g)
    return ents, Reps(torch.randn(probe, cols, dim, generator=g), torch.arange(cols)[None, :] < q_len[:, None])
