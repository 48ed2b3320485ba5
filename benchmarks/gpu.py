"""The GPU benchmark (issue 23): exact hard negatives at top-k cost, the refresh's encode rate and
the DeepSpeed step, on one GPU, with only torch and Triton needed for the first two.

Sections, each written to ``<out>/gpu_<section>.json`` as soon as it ends (a run cut short keeps
what it finished), with the device name and the torch, CUDA and Triton versions:

* ``law``: the new path's correctness on the device at small size: sharded == flat bit for bit
  (block sampler; pieces, dead rows, two golds per query), top-k equal to the torch path's,
  and the sampler's law (first draw, ordered pairs, inclusion probabilities; chi-square
  against the exact successive-sampling law, with a negative control that must be rejected).
* ``shard``: a shard on the device answers the calls the service makes, with host queries, golds and
  rows as the service sends them, as the same shard on the CPU does, and on the host: top-k, the hard
  sample, the scores of given rows, and the bias monitor's log-sum-exp and gradient over all rows and
  over given rows; dual and multi-8, fp32, two pieces and dead rows (ids agree on > 99%, values within 1e-3).
* ``mining``: 5,903,530 x 1024 bf16 random entity rows (12.1 GB), B in {128, 1024}, K-1 = 63,
  ``ShardIndex`` with the torch backend, ``score_dtype: bf16``, ``sampler: block`` and every
  other option at its default (``device: auto``, ``chunk_rows: 0`` = auto, ``kernel: auto``),
  and the same with ``storage: bf16, compute: bf16`` (the GEMM writes bf16 scores, as the baseline
  does), against a plain chunked bf16 GEMM + ``torch.topk`` (1M-row chunks) in the same run,
  interleaved, after a warm-up; the old defaults (``chunk_rows: 8192``, ``kernel: torch``) once
  each for reference; one read of the embeddings (an ``amax`` over them) and the copy rate;
  the operators and host synchronisations of one call, counted with torch.profiler.
* ``encode``: :mod:`benchmarks.gpu_encode` (BERT-large T = 128 through the shard's encode path).
* ``train``: :mod:`benchmarks.gpu_train` (the retriever step, plain torch vs the project's
  DeepSpeed engine; skipped where DeepSpeed is not installed).

``peak``: a bf16 8192^3 GEMM in the same run, the denominator of every MFU.

    python -m benchmarks.gpu --out /tmp/gpu                 # the full run on a GPU
    python -m benchmarks.gpu --quick --device cpu --out /tmp/q   # tiny sizes, CPU (Triton interpreted)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import LOAD_LIMIT, RESULTS_DIR, compare, interleaved, load_guard, print_table, save_results
from benchmarks.gpu_common import device_info, gemm_peak, profiled, sync, synced, timed
from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import Piece, auto_chunk_rows, exact_search, exact_search_pieces
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling import negatives as ng
from dist_nce.sampling.topk import merge_results

DUAL = ScoreSpec.preset("dual")
KILT_ROWS = 5_903_530


# --------------------------------------------------------------------------- counting operators


def op_counts(fn: Callable[[], Any], device: torch.device) -> dict:
    """Operators one call of ``fn`` runs, from torch.profiler: top-level operators (all, and less
    views and allocations), device kernels (CUDA), host synchronisations (CUDA stream/device
    syncs, ``aten::_local_scalar_dense`` i.e. ``.item()``/``bool()`` of a device value), host
    copy calls, and Triton launches."""
    from torch.autograd import DeviceType

    events = list(profiled(fn, device).events())
    # top-level operators only (an aten op's own sub-ops are one operator; what Triton's
    # interpreter runs inside a launch on a CPU sits below the launch's record_function)
    top = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    return {"operators": len(top),
            "operators_not_views": sum(1 for e in top if e.name not in _VIEWS),
            "device_kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
            "host_syncs": sum(1 for e in cpu if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                            "aten::_local_scalar_dense")),
            "memcpy_calls": sum(1 for e in cpu if e.name in ("cudaMemcpyAsync", "cudaMemcpy")),
            "triton_launches": sum(1 for e in top if e.name == "dist_nce::block_keys")}


_VIEWS = {"aten::alias", "aten::slice", "aten::view", "aten::unsqueeze", "aten::expand", "aten::t", "aten::select",
          "aten::as_strided", "aten::reshape", "aten::transpose", "aten::permute", "aten::squeeze", "aten::empty",
          "aten::empty_like", "aten::empty_strided"}


# --------------------------------------------------------------------------- law section


def law(device: torch.device, quick: bool) -> dict:
    """Correctness of the fused path on ``device`` (module docstring)."""
    from dist_nce.sampling.laws import successive_law, two_sample_p

    kernel = "auto" if device.type == "cuda" else "triton"
    out: dict[str, Any] = {"kernel": kernel}
    g = torch.Generator().manual_seed(7)
    n, d, batch = (6_000, 32, 24) if quick else (300_000, 128, 64)
    e = (torch.randn(n, d, generator=g) * 0.3).bfloat16().to(device)
    q = (torch.randn(batch, d, generator=g)).bfloat16().float().to(device)
    gold = torch.randint(0, n, (batch, 2), generator=g).to(device)
    gold[::3, 1] = -1
    dead = torch.tensor([5, 700, 701, n - 1])
    chunk, block = (1024, 64) if quick else (65_536, 128)
    kw = dict(chunk_rows=chunk, seed=9, query_keys=torch.arange(batch, device=device) * 5 + 1, sampler="block",
              block_rows=block, kernel=kernel, dead=dead)
    flat = exact_search(DUAL, Reps(q), Reps(e), 0, 63, gold, **kw)
    cut = [0, chunk * 2 - block, chunk * 2, n // 2 // block * block, n]  # a shard of one block; pieces
    parts = [exact_search_pieces(DUAL, Reps(q), [Piece(cut[0], Reps(e[cut[0]:cut[1]])),
                                                 Piece(cut[2], Reps(e[cut[2]:cut[3]]))], 63, gold, **kw),
             exact_search(DUAL, Reps(q), Reps(e[cut[1]:cut[2]]), cut[1], 63, gold, **kw),
             exact_search(DUAL, Reps(q), Reps(e[cut[3]:]), cut[3], 63, gold, **kw)]
    merged = merge_results(parts, 63)
    out["sharded_equals_flat"] = bool(torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
                                      and torch.equal(merged.scores, flat.scores))
    out["gold_never_drawn"] = not bool((flat.ids[:, :, None] == gold[:, None, :]).any())
    out["dead_never_drawn"] = not bool(torch.isin(flat.ids.cpu(), dead).any())
    ids = flat.ids.cpu()
    out["no_duplicates"] = bool((ids.sort(1).values.diff(dim=1) != 0).all())
    ref = exact_search(DUAL, Reps(q), Reps(e), 0, 63, gold, **{**kw, "kernel": "torch"})
    out["same_sample_as_torch_path"] = float((ref.ids.cpu() == ids).double().mean())
    top = exact_search(DUAL, Reps(q), Reps(e), 0, 63, gold, **{**kw, "seed": None})
    top_ref = exact_search(DUAL, Reps(q), Reps(e), 0, 63, gold, **{**kw, "seed": None, "kernel": "torch"})
    out["topk_ids_equal_torch_path"] = float((top.ids.cpu() == top_ref.ids.cpu()).double().mean())
    out["topk_max_score_diff"] = float((top.scores.cpu() - top_ref.scores.cpu()).abs().max())
    # the law: 40 rows in blocks of 8, K-1 = 3 (3 of 5 blocks kept per draw), row 0 the gold
    rows, draws, k = 40, (20_000 if quick else 200_000), 3
    s = torch.linspace(-1.5, 2.0, rows)[torch.randperm(rows, generator=torch.Generator().manual_seed(5))]
    s = s.bfloat16().float()
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, score_dtype="bf16",
                      kernel="auto" if device.type == "cuda" else "triton", device=str(device))
    qd = torch.ones(draws, rows, device=device)
    golds = torch.zeros(draws, dtype=torch.int64, device=device)
    res = merge_results([ShardIndex(DUAL, Reps(torch.diag(s)[a:b]), a, cfg).gumbel_topk(
        qd, k, golds, 17, torch.arange(draws, device=device)) for a, b in [(0, 16), (16, 24), (24, 40)]], k)
    out.update(successive_law(res.ids, s, 1.1))
    dense = ng.sample_hard(s.expand(draws, rows), 2, golds.cpu(), 4, torch.arange(draws)).ids
    out["vs_dense_sampler_p"] = two_sample_p(res.ids[:, 0] * rows + res.ids[:, 1],
                                             dense[:, 0] * rows + dense[:, 1], rows * rows)
    out["draws"] = draws
    control = 1e-2 if quick else 1e-6  # the negative control's power grows with the draws
    out["passed"] = bool(out["sharded_equals_flat"] and out["gold_never_drawn"] and out["dead_never_drawn"]
                         and out["no_duplicates"] and out["first_draw_p"] > 1e-4 and out["ordered_pairs_p"] > 1e-4
                         and out["wrong_temperature_p"] < control and out["inclusion_max_z"] < 5
                         and out["vs_dense_sampler_p"] > 1e-4 and out["topk_ids_equal_torch_path"] > 0.99)
    return out


def shard_calls(device: torch.device, quick: bool) -> dict:
    """A shard on ``device`` answers the service's calls as a CPU shard does (module docstring)."""
    from dist_nce.index.live import LiveIndex

    g = torch.Generator().manual_seed(3)
    n, d, batch, k = (640, 16, 6, 8) if quick else (20_000, 64, 16, 16)
    dead = torch.tensor([3, n // 2, n - 1])
    out: dict[str, Any] = {}
    for name, spec, ents in (("dual", DUAL, torch.randn(n, d, generator=g) * 0.3),
                             ("multi8", ScoreSpec.preset("multi", m=8), torch.randn(n, 8, d, generator=g) * 0.3)):
        def live(dev: torch.device) -> LiveIndex:
            cfg = IndexConfig(backend="torch", device=str(dev), chunk_rows=256 if quick else 4096)
            half = n // 2
            return LiveIndex([ShardIndex(spec, Reps(ents[:half].to(dev)), 0, cfg),
                              ShardIndex(spec, Reps(ents[half:].to(dev)), half, cfg)], dead, 0)
        on, ref = live(device), live(torch.device("cpu"))
        # what the service sends: host tensors
        q = torch.randn(batch, d, generator=g)
        gold = torch.randint(0, n, (batch,), generator=g)
        keys = torch.arange(batch) * 7 + 1
        rows = torch.randint(0, n, (batch, 2, k), generator=g)
        calls = {"topk": lambda ix: ix.topk(q, k, gold).ids,
                 "gumbel_topk": lambda ix: ix.gumbel_topk(q, k, gold, 11, keys).ids,
                 "score_rows": lambda ix: ix.score_rows(q, rows[:, 0]),
                 "lse_grad_all": lambda ix: torch.cat([t.reshape(batch, -1) for t in ix.lse_grad(q)], 1),
                 "lse_grad_rows": lambda ix: torch.cat([t.reshape(batch, -1) for t in ix.lse_grad(q, rows)], 1)}
        for call, fn in calls.items():
            got, want = fn(on), fn(ref)
            key = f"{name}_{call}"
            out[f"{key}_on_host"] = got.device.type == "cpu"
            if got.dtype == torch.int64:  # ids: near-ties may order differently on another device
                out[f"{key}_ids_equal"] = float((got == want).double().mean())
            else:
                out[f"{key}_max_diff"] = float((got.double() - want.double()).abs().max())
    out["passed"] = bool(all(v for k, v in out.items() if k.endswith("_on_host"))
                         and all(v > 0.99 for k, v in out.items() if k.endswith("_ids_equal"))
                         and all(v < 1e-3 for k, v in out.items() if k.endswith("_max_diff")))
    return out


# --------------------------------------------------------------------------- mining section


def plain_topk(q: torch.Tensor, ents: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: chunked bf16 GEMM + torch.topk per chunk, then a top-k of the candidates."""
    vals, ids = [], []
    for a in range(0, ents.shape[0], chunk):
        v, i = torch.topk(q @ ents[a:a + chunk].t(), k, dim=1)
        vals.append(v)
        ids.append(i + a)
    v, i = torch.cat(vals, 1), torch.cat(ids, 1)
    top = torch.topk(v, k, dim=1)
    return i.gather(1, top.indices).cpu(), top.values.float().cpu()


def make_entities(n: int, d: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """n x d bf16 rows, filled in slices (no fp32 copy of the whole matrix)."""
    ents = torch.empty((n, d), dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    step = 1 << 19
    for a in range(0, n, step):
        b = min(n, a + step)
        ents[a:b] = torch.randn((b - a, d), generator=g, device=device).mul_(d ** -0.5)
    return ents


def mining(device: torch.device, quick: bool) -> dict:
    n, d = (40_000, 64) if quick else (KILT_ROWS, 1024)
    batches = (8, 64) if quick else (128, 1024)
    k, repeats = 63, (2 if quick else 5)
    ents = make_entities(n, d, device)
    sync(device)
    out: dict[str, Any] = {"rows": n, "dim": d, "k": k, "bytes": ents.numel() * 2, "rows_by_batch": []}
    # one read of the embeddings, and the copy rate (bytes read + written per second)
    out["one_read"] = timed(lambda: ents.amax(), device, repeats)
    part = ents[: n // 3]
    dst = torch.empty_like(part)
    copy = timed(lambda: dst.copy_(part), device, repeats)
    out["copy_tb_per_s"] = 2 * part.numel() * 2 / copy["min"] / 1e12
    out["one_read_at_copy_rate_s"] = ents.numel() * 2 / (out["copy_tb_per_s"] * 1e12 / 2)
    dst = None  # free the copy target
    kernel = "auto" if device.type == "cuda" else "triton"
    new = IndexConfig(backend="torch", score_dtype="bf16", sampler="block", kernel=kernel, device=str(device))
    old = IndexConfig(backend="torch", score_dtype="bf16", sampler="block", kernel="torch", chunk_rows=8192,
                      device=str(device))
    idx_new, idx_old = ShardIndex(DUAL, Reps(ents), 0, new), ShardIndex(DUAL, Reps(ents), 0, old)
    # storage + compute bf16: the GEMM writes bf16 scores (as the plain baseline does), half the bytes
    # of score_dtype bf16's fp32 sums; the same fused path reads them
    idx_b16 = ShardIndex(DUAL, Reps(ents), 0, IndexConfig(backend="torch", storage="bf16", compute="bf16",
                                                          sampler="block", kernel=kernel, device=str(device)))
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        q = torch.randn(batch, d, generator=g).bfloat16().to(device)
        gold = torch.randint(0, n, (batch,), generator=g)
        keys = torch.arange(batch)
        plain_chunk = min(1 << 20, n)
        methods = {
            "plain GEMM + topk": lambda: plain_topk(q, ents, k, plain_chunk),
            "exact top-k": lambda: idx_new.topk(q.float(), k, gold),
            "exact block Gumbel-top-k": lambda: idx_new.gumbel_topk(q.float(), k, gold, 3, keys),
            "exact top-k, bf16 scores": lambda: idx_b16.topk(q, k, gold),
            "exact block Gumbel-top-k, bf16 scores": lambda: idx_b16.gumbel_topk(q, k, gold, 3, keys),
        }
        runs = interleaved({name: synced(f, device) for name, f in methods.items()}, repeats, 1)
        row: dict[str, Any] = {"batch": batch, "chunk_rows": auto_chunk_rows(device, batch, 128, vector_bytes=d * 2)}
        row["chunks"] = -(-n // row["chunk_rows"])
        for name, r in runs.items():
            row[name] = r
        base = runs["plain GEMM + topk"]
        row["topk_vs_plain"] = compare(runs["exact top-k"], base)
        row["sampler_vs_plain"] = compare(runs["exact block Gumbel-top-k"], base)
        row["topk_bf16_vs_plain"] = compare(runs["exact top-k, bf16 scores"], base)
        row["sampler_bf16_vs_plain"] = compare(runs["exact block Gumbel-top-k, bf16 scores"], base)
        row["sampler_vs_one_read"] = runs["exact block Gumbel-top-k"]["median"] / out["one_read"]["median"]
        row["old defaults (chunk 8192, torch), block sampler"] = timed(
            lambda: idx_old.gumbel_topk(q.float(), k, gold, 3, keys), device, 1, warmup=1)
        row["ops_sampler"] = op_counts(lambda: idx_new.gumbel_topk(q.float(), k, gold, 3, keys), device)
        row["ops_topk"] = op_counts(lambda: idx_new.topk(q.float(), k, gold), device)
        # the same call over twice the chunks: what one more chunk adds
        half = ShardIndex(DUAL, Reps(ents), 0, IndexConfig(
            backend="torch", score_dtype="bf16", sampler="block", kernel=kernel, device=str(device),
            chunk_rows=row["chunk_rows"] // 2))
        row["ops_sampler_half_chunks"] = op_counts(lambda: half.gumbel_topk(q.float(), k, gold, 3, keys), device)
        extra = -(-n // (row["chunk_rows"] // 2)) - row["chunks"]
        row["ops_per_chunk"] = {key: (row["ops_sampler_half_chunks"][key] - row["ops_sampler"][key]) / max(extra, 1)
                                for key in row["ops_sampler"]}
        out["rows_by_batch"].append(row)
        print_table([{"path": name, **{x: r[x] * 1e3 for x in ("min", "median", "max")}}
                     for name, r in runs.items()],
                    [("path", f"B = {batch}", "<28s"), ("min", "min ms", ">9.2f"), ("median", "median ms", ">9.2f"),
                     ("max", "max ms", ">9.2f")])
        sys.stdout.flush()
    return out


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU tests)")
    ap.add_argument("--sections", default="law,mining,encode,train")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="folder for gpu_<section>.json")
    ap.add_argument("--force", action="store_true", help="record above the load limit (marked noisy)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    # the GPU's host CPUs only launch kernels; the limit scales with them (1.5 on 2 cores)
    guard = load_guard(args.force or args.quick, max(LOAD_LIMIT, 0.75 * (os.cpu_count() or 2)))
    info = device_info(device)
    print(json.dumps(info))
    peak = gemm_peak(device, 512 if args.quick else 8192)
    print(f"bf16 GEMM peak: {peak['tflops_best']:.1f} TFLOP/s (median {peak['tflops_median']:.1f})")
    sections = [s for s in args.sections.split(",") if s]
    failed = []
    for name in sections:
        t0 = time.perf_counter()
        try:
            if name == "law":
                data = law(device, args.quick)
            elif name == "shard":
                data = shard_calls(device, args.quick)
            elif name == "mining":
                data = mining(device, args.quick)
            elif name == "encode":
                from benchmarks import gpu_encode
                data = gpu_encode.run(str(device), args.quick, peak["tflops_best"])
            elif name == "train":
                from benchmarks import gpu_train
                data = gpu_train.run(str(device), args.quick, peak["tflops_best"])
            else:
                raise ValueError(f"unknown section {name!r}")
            ok = data.get("passed", True) is not False  # a correctness section that did not pass fails the run
        except Exception as exc:  # keep the other sections' results
            data = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            ok = False
            print(data["traceback"], file=sys.stderr)
        if not ok:
            failed.append(name)
        data = {"section": name, "quick": args.quick, "seconds": time.perf_counter() - t0, "peak": peak,
                "info": info, **guard, **data}
        path = save_results(f"gpu_{name}", data, Path(args.out) / f"gpu_{name}.json")
        print(f"{name}: {'ok' if ok else 'FAILED'} in {data['seconds']:.1f} s -> {path}")
        sys.stdout.flush()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
