"""Refresh: re-encoding the KB with new entity-encoder weights, on CPU with MiniLM.

On 1,500 (by default) entities of a synthetic KILT knowledge source prepared with
``kb.prepare`` (entity max length 128), in ONE run, it times encoding the same rows:

1. naive: a single-process Hugging Face loop (``AutoModel``), fixed-order batches
   padded to the max length (128), fp32 -- the baseline;
2. + trim: the same batches, each cut to its own longest row (no sorting);
3. + length sorting: ``dist_nce.index.encode.encode_rows`` (batches of similar length,
   longest first, each cut to its longest row), fp32;
4. + bf16: the same with bf16 autocast (where the CPU runs bf16 fast: AVX512-BF16/AMX),
   transformers' sdpa attention (torch's CPU flash attention);
5. + native attention: the same with the attention kernel ``service.encode_attention: auto``
   picks (``index/attention.py``), where the CPU has AVX512-BF16;
6. + torch.compile: the same compiled as ``service.encode_compile`` does
   (``index.encode.compile_encoder``; the compile itself is in the untimed warm-up), and the
   compiled encoder with sdpa attention for comparison;
7. the service: ``NegativeService.refresh(new weights, version)`` on S shard actors of
   one thread each, timed from the call until every shard serves the new version
   (weights broadcast, encode, persist, index build, swap): with sdpa attention
   (``encode_attention: model``), with ``encode_attention: auto`` (the default), and with
   ``encode_compile`` (its compile is in its first, untimed encode, reported apart).

Rows 1-6 run in this process on ``--threads`` threads (default 1: on this shared 2-core
machine a 2-thread process is erratic, every parallel region waiting for a descheduled
thread), so the per-thread rate compares rows; the service's S processes x 1 thread
add the S-way split of a refresh (encode time / S). Timing is round-robin
over ``--rounds`` blocks of rows: each round runs rows 1-6 on its block, then one refresh
of the whole KB per service (new weights each time; the median refresh is reported), so load
from other processes falls on every row alike. Reported: entities/s, speed-up over the
naive loop, the share of computed token positions that are real tokens (padding
efficiency), achieved GFLOP/s (2 FLOPs per non-embedding parameter per computed
position plus attention) against threads x the one-thread GEMM rate of the row's dtype,
measured in the same run, and the largest difference of each row's embeddings from the naive
fp32 ones (a correctness check on the timed data).
Prints a table and writes benchmarks/results/refresh.json.

    .venv/bin/python -m benchmarks.refresh                   # 1,500 entities, S=2: ~5-10 minutes here
    .venv/bin/python -m benchmarks.refresh --entities 500    # a smoke run

The first run also generates and prepares the KB (cached under --data-dir).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


from benchmarks.common import add_hygiene_args, gemm_peaks, load_guard, machine_info, print_table, save_results  # noqa: E402
from dist_nce.cluster.runtime import configure_process, init_ray  # noqa: E402
from dist_nce.index.encode import (autocast_dtype, compile_encoder, encode_rows, length_sorted_batches,  # noqa: E402
                                   state_fingerprint)
from dist_nce.kernels.attention import use_native_attention  # noqa: E402


def prepared_kb(data_dir: Path, entities: int, seed: int) -> Path:
    """A synthetic KILT source of ``entities`` lines, prepared with kb.prepare (made once, reused
    while the size and seed stay the same)."""
    from kb.prepare import PrepareConfig, ensure_store
    from kb.synthetic.cache import ensure_kilt

    source, out = data_dir / "source", data_dir / "prepared"
    say = lambda m: print(m, flush=True)  # noqa: E731
    kb = ensure_kilt(source, entities, 0, 0, 0, seed, log=say)["kb"]
    ensure_store(PrepareConfig(out=str(out), kilt_ks=str(kb), entity_max_len=128, progress=False), say,
                 regenerate_from=source)
    return out


def naive_hf(model: torch.nn.Module, ids: np.ndarray, lengths: np.ndarray, batch: int, trim: bool) -> torch.Tensor:
    """[CLS] states of rows in order, ``batch`` at a time, padded to the store width (or, with
    ``trim``, to each batch's longest row); a plain transformers model, fp32."""
    out = []
    with torch.inference_mode():
        for a in range(0, len(ids), batch):
            width = int(lengths[a:a + batch].max()) if trim else ids.shape[1]
            x = torch.from_numpy(ids[a:a + batch, :width]).long()
            mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths[a:a + batch])[:, None]).long()
            out.append(model(input_ids=x, attention_mask=mask).last_hidden_state[:, 0].float())
    return torch.cat(out)


def batch_work(lengths: np.ndarray, batches: list[np.ndarray], width: int | None, params: int, hidden: int,
               layers: int) -> tuple[int, float]:
    """(token positions, forward FLOPs) of a batching that pads each batch to ``width`` or to its
    longest row: 2 FLOPs per non-embedding parameter per position, plus attention scores and
    values, 4 w^2 hidden per layer per sequence of width w."""
    positions = flops = 0
    for b in batches:
        w = width or int(lengths[b].max())
        positions += len(b) * w
        flops += len(b) * (2.0 * params * w + 4.0 * w * w * hidden * layers)
    return positions, flops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entities", type=int, default=1500)
    ap.add_argument("--shards", type=int, default=2, help="S shard actors (1 thread each)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the in-process rows (1: a 2-thread process "
                    "is erratic on a shared 2-core machine; the per-thread column compares across thread counts)")
    ap.add_argument("--batch", type=int, default=16, help="entities per forward, every row alike (on this CPU "
                    "16 runs MiniLM ~6%% faster than 64 and ~25%% faster than 128: activations stay in L2)")
    ap.add_argument("--rounds", type=int, default=3, help="row blocks timed round-robin (one service refresh each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="where the synthetic KB is prepared (reused)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile rows (service.encode_compile: in-process and a second service)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/refresh.json)")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    S, B = args.shards, args.batch
    T = args.threads
    configure_process(threads=T)
    guard = load_guard(args.force)
    load_before = guard["load_average_before"]

    from dist_nce.actors.config import ServiceConfig
    from dist_nce.actors.service import NegativeService
    from dist_nce.core.models import default_model_dir
    from dist_nce.core.text import load_tokenizer, tokenizer_fingerprint
    from dist_nce.index.config import IndexConfig
    from dist_nce.index.versions import version_dir_name
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig
    from kb.store import EntityStore

    data_dir = Path(args.data_dir or Path(tempfile.gettempdir()) / "dist-nce-bench" / f"refresh-{args.entities}")
    store_dir = prepared_kb(data_dir, args.entities, args.seed)
    store = EntityStore(store_dir)
    n = store.num_entities
    rows = np.arange(n)
    ids, lengths = store.token_ids(rows), store.lengths(rows)
    model_dir = default_model_dir()
    config = RetrieverConfig(preset="dual", mention_model=model_dir, storage_dtype="float32")
    entity = EntityEncoder(Encoder.from_pretrained(model_dir), config.spec(), config.trim_padding).eval()
    bf16 = autocast_dtype("auto", torch.device("cpu"))
    peak = gemm_peaks(1)  # per thread; bf16 at 512^2 where it is emulated (no bf16 units: minutes at 2048^2)
    print(f"{n:,} entities, tokens per entity: mean {lengths.mean():.1f}, max {lengths.max()} (width "
          f"{store.max_len}); GEMM on 1 thread: fp32 {peak['fp32']:.0f}, bf16 {peak['bf16']:.0f} GFLOP/s; "
          f"fast bf16: {bf16 is not None}; load average {load_before:.1f} on {os.cpu_count()} cores", flush=True)

    from transformers import AutoModel

    cpu = torch.device("cpu")
    hf = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    shape = (sum(p.numel() for name, p in hf.named_parameters() if not name.startswith(("embeddings", "pooler"))),
             hf.config.hidden_size, hf.config.num_hidden_layers)

    # name -> (run on rows [a, b) -> [b - a, d] or None, batching of [a, b) -> (positions, FLOPs), compute dtype)
    def order(a: int, b: int, width: int | None) -> tuple[int, float]:
        return batch_work(lengths[a:b], [np.arange(i, min(i + B, b - a)) for i in range(0, b - a, B)], width, *shape)

    def by_length(a: int, b: int) -> tuple[int, float]:
        return batch_work(lengths[a:b], length_sorted_batches(lengths[a:b], B), None, *shape)

    methods = {
        "naive HF loop: row order, pad to 128, fp32": (
            lambda a, b: naive_hf(hf, ids[a:b], lengths[a:b], B, trim=False), lambda a, b: order(a, b, store.max_len),
            "fp32"),
        "+ trim each batch to its longest row": (
            lambda a, b: naive_hf(hf, ids[a:b], lengths[a:b], B, trim=True), lambda a, b: order(a, b, None), "fp32"),
        "+ length-sorted batches (encode_rows), fp32": (
            lambda a, b: encode_rows(entity, store.slice(a, b), B, cpu, None, "float32").vecs, by_length, "fp32"),
    }
    native_entity, why_not = None, "this CPU has no fast bf16"
    if bf16 is not None:
        methods["+ bf16 autocast (sdpa attention)"] = (
            lambda a, b: encode_rows(entity, store.slice(a, b), B, cpu, bf16, "float32").vecs, by_length, "bf16")
        native_entity = copy.deepcopy(entity)
        why_not = use_native_attention(native_entity)
        if why_not is None:
            methods["+ native attention (service.encode_attention: auto)"] = (
                lambda a, b: encode_rows(native_entity, store.slice(a, b), B, cpu, bf16, "float32").vecs, by_length,
                "bf16")
        else:
            native_entity = None
    else:
        print("bf16 rows skipped: this CPU has no fast bf16 (no AVX512-BF16/AMX)")
    if native_entity is None:
        print(f"native attention rows skipped: {why_not}")
    compile_rows = not args.no_compile
    dtype = "bf16" if bf16 else "fp32"
    if compile_rows:  # what service.encode_compile does in each shard, here in-process
        compiled = compile_encoder(copy.deepcopy(entity))
        methods[f"+ torch.compile (service.encode_compile), {dtype}, sdpa attention"] = (
            lambda a, b: encode_rows(compiled, store.slice(a, b), B, cpu, bf16, "float32").vecs, by_length, dtype)
        if native_entity is not None:
            compiled_native = compile_encoder(copy.deepcopy(native_entity))
            methods[f"+ torch.compile (service.encode_compile), {dtype}, native attention"] = (
                lambda a, b: encode_rows(compiled_native, store.slice(a, b), B, cpu, bf16, "float32").vecs,
                by_length, dtype)
    # (encode_compile, encode_attention) of each service
    service_names = {(False, "model"): f"service, sdpa attention: refresh() -> served, S={S} x 1 thread"}
    if native_entity is not None:
        service_names[(False, "auto")] = f"service, encode_attention auto: refresh() -> served, S={S} x 1 thread"
    if compile_rows:
        service_names[(True, "auto")] = f"service, encode_compile: refresh() -> served, S={S} x 1 thread"

    # ---- the services (sdpa, native attention, compiled): S shards x 1 thread each; time from refresh() to
    # the new version being served. All are alive at once, each shard holding a share of Ray's CPUs;
    # they refresh one after the other, never together.
    init_ray(num_cpus=os.cpu_count())
    services, run_dirs, first_encode = {}, {}, {}
    state = entity.state()
    for (compile_flag, attention), name in service_names.items():
        run_dirs[name] = tempfile.mkdtemp(prefix="dist-nce-refresh-")
        service_cfg = ServiceConfig(num_shards=S, num_cpus=os.cpu_count() / S / len(service_names), threads=1,
                                    encode_batch_size=B, encode_dtype="auto", encode_compile=compile_flag,
                                    encode_attention=attention, keep_versions=1, index=IndexConfig(backend="flat"))
        services[name] = NegativeService.create(
            str(store_dir), config, service_cfg, run_dirs[name],
            tokenizer_sha256=tokenizer_fingerprint(load_tokenizer(model_dir))["sha256"])
        t0 = time.perf_counter()
        services[name].ensure_encoded(state, 0)  # untimed: includes the compile of encode_compile
        first_encode[name] = time.perf_counter() - t0

    # ---- round-robin: round r runs every in-process method on block r of the rows, then one refresh of
    # the whole KB per service, so load from other processes falls on every row alike
    for name, (run, _, _) in methods.items():  # warm-up, untimed: kernel selection, allocator, first touch,
        run(0, min(B, n))                      # the compile of the compiled row
    seconds = {name: 0.0 for name in methods}
    work = {name: [0, 0.0] for name in methods}
    parts: dict[str, list] = {name: [] for name in methods}
    refreshes = {name: [] for name in services}
    encodes = {name: [] for name in services}
    attentions = {name: set() for name in services}
    serves_new = {name: True for name in services}
    blocks = [(r * n // args.rounds, (r + 1) * n // args.rounds) for r in range(args.rounds)]
    for r, (a, b) in enumerate(blocks):
        for name, (run, batching, _) in methods.items():
            t0 = time.perf_counter()
            parts[name].append(run(a, b))
            seconds[name] += time.perf_counter() - t0
            work[name] = [x + y for x, y in zip(work[name], batching(a, b))]
        # new weights (as after training steps): a new fingerprint, so every shard re-encodes
        new_state = {**state, "weights": {k: v * (1 + 1e-3 * (r + 1)) if "LayerNorm.weight" in k else v
                                          for k, v in state["weights"].items()}}
        for name, service in services.items():
            t0 = time.perf_counter()
            served = service.refresh(new_state, r + 1).wait()
            refreshes[name].append(time.perf_counter() - t0)
            # each shard records its own encode time in the version's manifest: the rest of the refresh is
            # weights broadcast, persist, index build and swap
            manifests = [json.loads(m.read_text()) for m in Path(run_dirs[name], "shards").glob(
                f"shard-*/{version_dir_name(r + 1)}/manifest.json")]
            encodes[name].append(max(m["encode_seconds"] for m in manifests))
            attentions[name] |= {m["encode_attention"] for m in manifests}
            fingerprints = {st["encoder_fingerprint"] for st in service.status()}
            serves_new[name] &= served == r + 1 and service.version() == r + 1 and \
                fingerprints == {state_fingerprint(new_state)}
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{seconds[m]:.0f}" for m in methods) + " s so far; "
              + "; ".join(f"refresh {refreshes[x][-1]:.1f} s (slowest shard's encode {encodes[x][-1]:.1f} s)"
                          for x in services), flush=True)
    for name, service in services.items():
        service.shutdown()
        shutil.rmtree(run_dirs[name], ignore_errors=True)
    peak = gemm_peaks(1, peak)  # measured again after the work: the higher of the two is the bar

    real = int(lengths.sum())
    results, embeddings = [], {}

    def add(name: str, secs: float, entities_per_s: float, positions: int, flops: float, dtype: str,
            threads: int, **extra) -> None:
        gflops = flops / secs / 1e9
        results.append({"method": name, "seconds": secs, "entities_per_s": entities_per_s, "threads": threads,
                        "entities_per_s_per_thread": entities_per_s / threads,
                        "real_token_fraction": real / positions, "gflops": gflops, "compute": dtype,
                        "fraction_of_gemm": gflops / threads / peak[dtype], **extra})

    for name, (_, _, dtype) in methods.items():
        add(name, seconds[name], n / seconds[name], *work[name], dtype, T)
        embeddings[name] = torch.cat(parts[name]).float()
    # each shard sorts its own rows; the whole-KB sorted batching is a close stand-in for its work
    for name in services:
        per_refresh = statistics.median(refreshes[name])
        add(name, per_refresh, n / per_refresh, *by_length(0, n), "bf16" if bf16 else "fp32", S,
            refresh_seconds_all=refreshes[name], slowest_shard_encode_s_all=encodes[name],
            encode_share_of_refresh=statistics.median(e / t for e, t in zip(encodes[name], refreshes[name])),
            first_encode_s=first_encode[name], serves_new_weights=serves_new[name],
            encode_dtype=str(bf16 or torch.float32).removeprefix("torch."),
            encode_compile=name == service_names.get((True, "auto")), encode_attention=sorted(attentions[name]))

    base = results[0]
    for r in results:
        r["x_naive"] = r["entities_per_s"] / base["entities_per_s"]
        if r["method"] in embeddings:
            diff = embeddings[r["method"]] - embeddings[base["method"]]
            r["max_abs_diff_vs_naive"] = float(diff.abs().max())
            r["max_rel_diff_vs_naive"] = float(diff.norm(dim=1).max() / embeddings[base["method"]].norm(dim=1).min())
    print(f"\nMiniLM (6 layers, hidden 384) on {n:,} entities, batch {B}, {T} thread(s) in-process vs {S} shards x 1 "
          f"thread; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print_table(results, [("method", "method", "<66s"), ("seconds", "s", ">7.1f"),
                          ("entities_per_s", "ent/s", ">7.1f"), ("x_naive", "x naive", ">7.2f"),
                          ("threads", "thr", ">3d"), ("entities_per_s_per_thread", "ent/s/thr", ">9.1f"),
                          ("real_token_fraction", "real tok", ">8.2f"),
                          ("gflops", "GFLOP/s", ">8.1f"), ("fraction_of_gemm", "of thr*GEMM", ">7.2f"),
                          ("max_rel_diff_vs_naive", "rel diff", ">8.1e")])
    for name in services:
        print(f"{name}: refreshes {', '.join(f'{t:.1f}' for t in refreshes[name])} s, of which the slowest shard's "
              f"encode {', '.join(f'{e:.1f}' for e in encodes[name])} s (the rest: broadcast, persist, index build, "
              f"swap); first encode {first_encode[name]:.1f} s")
    out = save_results("refresh", {
        **guard,
        "benchmark": "refresh", "entities": n, "batch": B, "shards": S, "model": "all-MiniLM-L6-v2",
        "entity_max_len": store.max_len, "mean_tokens": float(lengths.mean()), "gemm_gflops": peak,
        "fast_bf16": bf16 is not None, "rows": results,
        "machine": machine_info(threads_in_process=T, threads_per_shard=1, load_average_before=load_before),
    }, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
