"""The benchmark page, docs/benchmarks.md, generated from the committed JSON in benchmarks/results/.

Every figure the page gives for a benchmark stands between a pair of markers,

    <!-- bench:NAME -->
    ...generated markdown...
    <!-- /bench:NAME -->

and is rendered here from ``benchmarks/results/NAME.json`` (the run's own numbers: medians with
their min-max spread, ratios with the range their spreads allow, the load average the run
started at); the prose between the blocks is written by hand. ``tests/test_benchmarks_report.py``
fails when a block differs from what the committed JSON renders, or when a result has no block on
the page, so a table cannot drift from its measurement. The README quotes a few headline figures
and links here; docs/gpu.md, docs/real_data.md and docs/linking.md carry copies of one block each
(COPIES: the GPU mining table, the BLINK import's memory table, serving under load), rewritten and
checked with the page's.

    .venv/bin/python -m benchmarks.report            # rewrite the page's blocks from the JSON
    .venv/bin/python -m benchmarks.report --check    # exit 1 if any block is stale or missing
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "benchmarks.md"  # the generated page the README links to
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def _x(v: dict) -> str:
    """A cost ratio from benchmarks.common.compare: median [range the spreads allow]."""
    return f"{v['x_median']:.2f}x [{v['x_low']:.2f}-{v['x_high']:.2f}]" + ("" if v["distinct"] else " (overlap)")


def _run_line(data: dict) -> str:
    m = data.get("machine") if isinstance(data.get("machine"), dict) else data.get("meta", data)
    noisy = " NOISY (recorded above the load limit)" if data.get("noisy") else ""
    libs = "".join(f", {lib} {m[lib]}" for lib in ("torch", "faiss") if m.get(lib))
    return (f"Run: load average {data.get('load_average_before', float('nan')):.1f} before the start "
            f"(limit {data.get('load_limit', 1.5)}){noisy}; {m.get('cpu_count', m.get('cpus', '?'))} cores{libs}.")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines: the header, its separator, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def _ms(spread: dict, per: float = 1e3) -> str:
    return f"{per * spread['median']:.2f} ({per * spread['min']:.2f}-{per * spread['max']:.2f})"


def mining(data: dict) -> str:
    peaks = data["gemm_peaks"]["1"]
    lines = [f"N = {data['n']:,} x {data['d']} clustered vectors, K-1 = {data['k']}; top-k requests of "
             f"{data['batch']} queries, exact hard-negative requests of {data['gumbel_batch']}. Cost per query "
             "(median of the interleaved repeats, min-max in brackets) and its ratio to faiss flat top-k on the "
             "same threads (median [range the spreads allow]).", ""]
    lines += _table(["method", "ms/query", "vs faiss flat top-k", "GFLOP/s"],
                    [[row["method"], _ms(row["seconds_per_query"]), _x(row["vs_faiss_topk"]), f"{row['gflops']:.1f}"]
                     for row in data["rows"] if "vs_faiss_topk" in row])
    avx2 = data.get("avx2_kernel")
    if avx2:
        hidden = (f"with {avx2['masked']} hidden from the kernel checks (`DIST_NCE_NATIVE_MASK`), so this CPU takes "
                  f"the path of one without it" if avx2["masked"] else "on a CPU without AVX512-BF16")
        lines += ["", f"Rows \"({avx2['isa']} kernel ...)\": `native/block_fp32.c`, built with "
                  f"`{' '.join(f for f in avx2['cflags'] if f.startswith('-m'))}` (no AVX512 instruction), needing "
                  f"the CPU flags {' and '.join(avx2['needs'])}, run {hidden}. The other rows keep the kernels they "
                  "had before it: torch for fp32 rows, the AVX512-BF16 kernel (\"native\") or torch for bf16 rows."]
    lines += ["", "Through Ray (S shard actors of one thread each against one process of S threads):", ""]
    lines += _table(["method", "queries/s", "x in-process baseline (same work, S threads)"],
                    [[row["method"], f"{row['qps']:.1f}", f"{row['x_baseline']:.2f}"] for row in data["rows"]
                     if "service" in row["method"] or "no Ray" in row["method"]])
    agree = data.get("agreement") or {}
    lines += ["", f"GEMM peaks measured in the same run (torch.mm, 1 thread): fp32 {peaks['fp32']:.0f} GFLOP/s, "
              f"bf16 {peaks['bf16']:.0f} GFLOP/s ({'native' if peaks['bf16_native'] else 'emulated'}). "
              f"No-op fan-out to the shards: {data['noop_fanout_ms']:.1f} ms. Service answers equal the in-process "
              f"ones: top-k ids {100 * agree.get('topk_ids_equal_fraction', float('nan')):.0f}%, Gumbel ids "
              f"{100 * agree.get('gumbel_ids_equal_fraction', float('nan')):.0f}%.", _run_line(data)]
    return "\n".join(lines) + "\n"


def _memory_by_mode(data: dict) -> dict[str, dict]:
    """Per service (mode): its shards' raw MiB and worst (RSS - empty) / raw at rest and at the build peak."""
    out: dict[str, dict] = {}
    for row in data["memory"]:
        mode = row.get("mode", data["mining"][0]["mode"])  # older runs measured the first service only
        m = out.setdefault(mode, {"raw_mib": row["raw_mib"], "dtype": row.get("dtype", data["dtype"]), "rest": 0.0,
                                  "peak": 0.0})
        m["rest"] = max(m["rest"], row["ratio_rss_minus_empty"])
        m["peak"] = max(m["peak"], row["ratio_peak_minus_empty"] or 0.0)
    return out


def scale(data: dict) -> str:
    exact, flat = data["mining"][0], data["mining"][1]
    lines = [f"{data['entities']:,} x {data['d']} vectors over {data['shards']} shard actors "
             f"(one thread each, {data['shards']} processes on {data['machine'].get('cpu_count', '?')} cores); "
             f"{exact['queries']:,} queries (AIDA train), K-1 = {data['k']}, {data['batch']} per request, "
             f"{data['in_flight']} in flight; each pass over all the queries, measured to the end "
             "(one pass each, so no spread).", ""]
    lines += _table(["mining", "queries timed", "queries/s", "minutes for all", "cost vs faiss"],
                    [[row["mode"], f"{row['queries_measured']:,}" + (" (extrapolated)" if row["extrapolated"] else ""),
                      f"{row['qps']:.1f}", f"{row['minutes_for_all']:.1f}", f"{flat['qps'] / row['qps']:.2f}x"]
                     for row in (exact, flat)])
    floors = data.get("empty_shard_memory_by_mode") or {exact["mode"]: data["empty_shard_memory"]}
    mem = "; ".join(f"{mode}: {m['raw_mib']:.0f} MiB of raw {m['dtype']} vectors per shard, RSS minus an empty "
                    f"shard process ({floors[mode]['rss_mib']:.0f} MiB of Ray, torch and faiss) {m['rest']:.2f}x "
                    f"the raw bytes at rest and {m['peak']:.2f}x at the peak of the build"
                    for mode, m in _memory_by_mode(data).items())
    lines += ["", f"The faiss flat mode samples within each query's top 1,024 and misses on average "
              f"{100 * flat['truncation_mean']:.1f}% of the softmax mass (its estimate of the tail, reported, "
              f"not hidden); the exact mode samples from all entities. Memory (worst shard): {mem}.",
              _run_line(data)]
    return "\n".join(lines) + "\n"


def refresh(data: dict) -> str:
    peak = data["gemm_gflops"]
    lines = [f"{data['model']} over {data['entities']:,} synthetic entities ({data['mean_tokens']:.0f} tokens on "
             f"average, width {data['entity_max_len']}), batch {data['batch']}; in-process rows on one thread, the "
             f"service on {data['shards']} shard actors of one thread each; every method encodes the same rows in "
             "interleaved rounds. MFU = achieved GFLOP/s per thread over the same run's GEMM peak of the method's "
             "dtype.", ""]
    lines += _table(["method", "entities/s", "x naive", "GFLOP/s per thread", "MFU", "max rel. diff vs naive"],
                    [[row["method"], f"{row['entities_per_s']:.1f}", f"{row['x_naive']:.2f}",
                      f"{row['gflops'] / row['threads']:.0f} ({row['compute']})", f"{row['fraction_of_gemm']:.2f}",
                      "-" if row.get("max_rel_diff_vs_naive") is None else f"{row['max_rel_diff_vs_naive']:.1e}"]
                     for row in data["rows"]])
    lines += ["", f"GEMM peaks in the same run (1 thread{', ' + peak['method'] if peak.get('method') else ''}): "
              f"fp32 {peak['fp32']:.0f}, bf16 {peak['bf16']:.0f} GFLOP/s "
              f"({'native' if peak['bf16_native'] else 'emulated'})."]
    for svc in (r for r in data["rows"] if r["method"].startswith("service")):
        lines[-1] += (f" {svc['method'].split(':')[0].capitalize()}: a refresh, from `refresh()` to the new version "
                      f"served, {', '.join(f'{t:.1f}' for t in svc['refresh_seconds_all'])} s, of which the slowest "
                      f"shard's encoding is {100 * svc['encode_share_of_refresh']:.0f}% (the rest: weights broadcast, "
                      f"persist, index build, swap); its first encode {svc['first_encode_s']:.1f} s"
                      + (" (with the compile)." if svc.get("encode_compile") else "."))
    lines.append(_run_line(data))
    return "\n".join(lines) + "\n"


def train_step(data: dict) -> str:
    b = data["batch"]
    lines = [f"`{data['config']}` (model {Path(str(data['model'])).name}), {b['mentions']} mentions x "
             f"{b['candidates']} candidates, {b['mention_tokens']}/{b['entity_tokens']} tokens, {data['shards']} "
             f"shards, refresh `{data['refresh']}` ({data['refreshes_published']} KB refreshes published during the "
             f"run); the two DeepSpeed modes alternate in {data['rounds']} rounds. Step and part times are medians "
             "in seconds; wait % = time blocked on negatives over step time (min-max over rounds).", ""]
    cells = []
    for row in data["rows"]:
        step = row.get("step_spread")
        steps = f"{row['step']:.3f}" + (f" ({step['min']:.3f}-{step['max']:.3f})" if step else "")
        wait = row.get("wait_pct_spread")
        wait_s = f"{row['wait_pct']:.2f}" + (f" ({wait['min']:.2f}-{wait['max']:.2f})" if wait else "")
        refreshing = row.get("refreshing_pct")
        cells.append([row["mode"], str(row["steps"]), steps, wait_s, f"{row['negatives_pct']:.1f}",
                      f"{row['compute']:.3f}", "-" if refreshing is None else f"{refreshing:.0f}%"])
    lines += _table(["mode", "steps", "step s (min-max over rounds)", "wait %", "negatives %",
                     "forward+backward+optimizer s", "steps overlapping a refresh"], cells)
    r = data["ratios"]
    lines += ["", f"Synchronous mining over prefetching: {r['sync_over_prefetch_step']:.2f}x the step time; DeepSpeed "
              f"over a plain PyTorch loop on the same batches: {r['deepspeed_over_plain_compute']:.2f}x the compute.",
              _run_line(data)]
    return "\n".join(lines) + "\n"


def link(data: dict) -> str:
    a = data["args"]
    lines = [f"{a['mentions']} dev mentions of the demo's run (MiniLM dual encoder, {data['entities']:,} entities, "
             f"k = {a['k']}{', reranked' if a.get('reranker') else ''}), end to end (tokenize, encode, search), "
             f"{a['repeats']} interleaved repeats; Serve: one mention per HTTP request from {a['clients']} "
             "concurrent clients.", ""]
    lines += _table(["way", "mentions/s median (min-max)", "x naive", "top-1 equal to batched"],
                    [[row["way"], f"{row['median']:.1f} ({row['min']:.1f}-{row['max']:.1f})", f"{row['speedup']:.2f}",
                      f"{100 * row['top1_agree']:.0f}%"] for row in data["results"]])
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def serve_load(data: dict) -> str:
    a = data["args"]
    run = "a tiny run the benchmark builds, random tiny BERT" if data["run"].startswith("tiny") else data["run"]
    lines = [f"Well-formed requests of one KILT dev mention each ({run}, {data['entities']:,} entities, "
             f"k = {a['k']}), every client sending its requests one after another; the Serve app through its edge "
             f"with a {a['deadline']:g} s deadline from arrival (`request_timeout_s`"
             + (f"; the last row's clients ask for {a['tight']:g} s" if a.get("tight") else "") + "), Serve's proxy off; "
             "the Python "
             f"API links the same requests one at a time in one process. {a['repeats']} interleaved rounds: "
             "medians (min-max).", ""]

    def cell(row: dict, key: str, fmt: str, per: float = 1.0) -> str:
        v = row[key]
        return "-" if v is None else f"{per * v['median']:{fmt}} ({per * v['min']:{fmt}}-{per * v['max']:{fmt}})"

    lines += _table(["way", "clients", "deadline", "requests", "answered/s", "p50 ms", "p95 ms", "p99 ms",
                     "shed (503)", "late (504)", "slowest answer ms"],
                    [["Python API" if r["way"] == "python_api" else "Serve", str(r["clients"]),
                      "-" if r["way"] == "python_api" else f"{r.get('deadline_s', a['deadline']):g} s", str(r["requests"]),
                      cell(r, "ok_per_s", ".1f"), cell(r, "p50_s", ".0f", 1e3), cell(r, "p95_s", ".0f", 1e3),
                      cell(r, "p99_s", ".0f", 1e3), cell(r, "shed", ".0%"), cell(r, "late", ".0%"),
                      cell(r, "max_s", ".0f", 1e3)]
                     for r in data["results"]])
    return "\n".join([*lines, "", _run_line(data) + f" Load average {data['load_average_after']:.1f} at the end."]) \
        + "\n"


def _load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no committed result for the docs/benchmarks.md block")
    return json.loads(path.read_text(encoding="utf-8"))


def targets(results: Path) -> str:
    """Issue 12's targets, each read from the run that measures it."""
    mining_, scale_, refresh_, step_ = (_load(results, n) for n in ("mining", "scale", "refresh", "train_step"))
    by = {r["method"]: r for r in mining_["rows"]}
    block, dense = by["gumbel: exact block, 1 process x 1 thread"], by["gumbel: exact dense fp32, 1 process x 1 thread"]
    alone = by.get("gumbel: native kernel alone (scoring + block selection), 1 process x 1 thread")
    exact, flat = scale_["mining"]
    peak = max(m["peak"] for m in _memory_by_mode(scale_).values())
    services = [r for r in refresh_["rows"] if r["method"].startswith("service")]
    svc = max(services, key=lambda r: r["fraction_of_gemm"])
    inproc = max((r for r in refresh_["rows"] if not r["method"].startswith("service") and r["compute"] == "bf16"),
                 key=lambda r: r["fraction_of_gemm"], default=None)
    pre = step_["rows"][0]
    rows = [(f"exact hard-negative mining vs faiss flat top-k, 1 thread, {mining_['n'] / 1e6:g}M x {mining_['d']}",
             "<= 1.2x", f"block {_x(block['vs_faiss_topk'])}; dense fp32 {_x(dense['vs_faiss_topk'])}",
             block["vs_faiss_topk"]["x_high"] <= 1.2),
            *_avx2_target(mining_),
            ("exact scoring vs the same run's bf16 GEMM peak, whole sampler (and the kernel alone)", ">= 50%",
             f"{100 * block['fraction_of_bf16_peak']:.0f}%"
             + (f" ({100 * alone['fraction_of_bf16_peak']:.0f}%)" if alone else ""),
             block["fraction_of_bf16_peak"] >= 0.5),
            (f"{scale_['entities']:,}-entity exact pass over {exact['queries']:,} queries vs the faiss pass, "
             "to the end", "<= 1.2x",
             f"{flat['qps'] / exact['qps']:.2f}x ({exact['seconds_measured']:.0f} s vs {flat['seconds_measured']:.0f} s"
             f"{', extrapolated' if exact['extrapolated'] or flat['extrapolated'] else ''})",
             flat["qps"] / exact["qps"] <= 1.2 and not (exact["extrapolated"] or flat["extrapolated"])),
            ("shard memory at the peak of the build vs raw vector bytes (5.9M)", "<= 1.3x", f"{peak:.2f}x",
             peak <= 1.3),
            ("KB refresh MFU vs the same run's bf16 peak", ">= 60%",
             "; ".join(f"{r['method'].split(':')[0]} {100 * r['fraction_of_gemm']:.0f}%" for r in services)
             + (f"; best one process {100 * inproc['fraction_of_gemm']:.0f}%" if inproc else ""),
             svc["fraction_of_gemm"] >= 0.6),
            ("time blocked on negatives, async refresh in flight", "< 5% of the step",
             f"{pre['wait_pct']:.2f}% ({pre.get('refreshing_pct', 0):.0f}% of steps overlapped a refresh)",
             pre["wait_pct"] < 5 and pre.get("refreshing_pct", 0) > 0)]
    return "\n".join(_table(["target", "goal", "measured", "met"],
                            [[what, goal, got, "yes" if ok else "**no**"] for what, goal, got, ok in rows])) + "\n"


def _avx2_target(mining_: dict) -> list[tuple]:
    """Issue 39's target: exact mining on a CPU without AVX512-BF16 (the AVX2+FMA kernel's rows), when the
    run has them."""
    avx2 = mining_.get("avx2_kernel")
    if not avx2:
        return []
    by = {r["method"]: r for r in mining_["rows"]}
    short = {name: name.split(" (")[0].replace("gumbel: exact ", "").replace("topk: exact ", "top-k ")
             for name in avx2["rows"]}
    got = {short[name]: by[name]["vs_faiss_topk"] for name in avx2["rows"]}
    return [(f"exact mining without AVX512-BF16 ({avx2['isa']} kernel) vs faiss flat top-k, 1 thread, "
             f"{mining_['n'] / 1e6:g}M x {mining_['d']}", "<= 1.2x",
             "; ".join(f"{what} {_x(v)}" for what, v in got.items()), all(v["x_high"] <= 1.2 for v in got.values()))]


def scoring(data: dict) -> str:
    lines = [f"{data['batch']} mentions per call, hidden {data['dim']}, {data['seq']} tokens, "
             f"{data['threads']} thread; \"loop\" scores one entity at a time, \"unfused\" is the seed code's "
             "single einsum that materialises every product (medians of repeated calls).", ""]
    lines += _table(["preset", "dtype", "entities", "scores/s", "x loop", "x unfused",
                     "max rel. diff vs loop / vs unfused"],
                    [[row["preset"] if row.get("m") is None else f"{row['preset']}-{row['m']}", row["dtype"],
                      f"{row['entities']:,}", f"{row['fast_scores_per_s']:.3g}", f"{row['speedup_vs_loop']:.1f}",
                      f"{row['speedup_vs_unfused']:.2f}",
                      f"{row['max_rel_diff_vs_loop']:.1e} / {row['max_rel_diff_vs_unfused']:.1e}"]
                     for row in data["rows"]])
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def search(data: dict) -> str:
    meta = data["meta"]
    lines = [f"N = {meta['n']:,} x {meta['d']} clustered vectors, {meta['batch']} queries, k = {meta['k']}, "
             f"{meta['threads']} thread. Recall against the exact top-k; for Gumbel rows the overlap of the sample "
             "with the top-k (a property of the sample, not an error).", ""]
    lines += _table(["search", "queries/s", "x flat fp32", "recall (or overlap)", "max score error", "build s"],
                    [[row["backend"], f"{row['qps']:.1f}", f"{row['speed_vs_flat_fp32']:.2f}",
                      f"{row.get('recall', row.get('overlap_with_topk')):.3f}", f"{row['max_score_err']:.1e}",
                      f"{row['build_s']:.2f}"] for row in data["rows"]])
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def ingest(data: dict) -> str:
    lines = [f"Synthetic KILT knowledge source ({data['entities']:,} entities, {data['kb_bytes'] / 2**20:.0f} MiB), "
             f"tokenized to {data['entity_max_len']} tokens with the MiniLM tokenizer into the prepared Arrow store; "
             f"the naive baseline reads its first {data['baseline_entities']:,} lines one tokenizer call each. Token "
             f"ids equal the baseline's on {100 * data['token_agreement_with_baseline']:.0f}% of the checked "
             "entities. The runs follow one another once each (whole-process runs: no interleaving, no spread).", ""]
    lines += _table(["run", "entities", "entities/s", "entities per CPU-s", "x naive", "peak anonymous memory"],
                    [[row["name"], f"{row['entities']:,}", f"{row['entities_per_s']:.0f}",
                      f"{row['entities_per_cpu_s']:.0f}", f"{row['speedup_vs_baseline']:.2f}",
                      f"{row['peak_anon_tree_mib']:.0f} MiB"] for row in data["runs"]])
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def update(data: dict) -> str:
    """KB delta (issue 15's target: >= 50x faster than a rebuild, memory following the delta), one
    table row pair per KB size of the run."""
    sizes = data.get("sizes") or [data]  # one size per file before sizes were measured together
    first = sizes[0]
    share = lambda key: f"{first[key] / first['entities']:.0%}"  # noqa: E731
    lines = [f"Deltas adding {share('added')} and removing {share('removed')} of the KB, {data['shards']} shards, "
             f"the {data['model']} encoder; {data['repeats']} interleaved rounds per size (min / median / max s).", ""]
    rows, notes = [], []
    for size in sizes:
        d, r = size["seconds"]["delta"], size["seconds"]["rebuild"]
        dl, rb = size["records"]["delta"], size["records"]["rebuild"]
        n = f"{size['entities']:,}"
        rows += [[n, f"delta: update_kb (+{size['added']:,} -{size['removed']:,}) + apply_delta on the running "
                     "service", f"{d['min']:.2f}", f"{d['median']:.2f}", f"{d['max']:.2f}",
                  f"{max(rec['update_peak_rss_mib'] for rec in dl):.0f} MiB (update)"],
                 [n, "full rebuild: prepare + encode every row", f"{r['min']:.1f}", f"{r['median']:.1f}",
                  f"{r['max']:.1f}", f"{max(rec['prepare_peak_rss_mib'] for rec in rb):.0f} MiB (prepare)"]]
        growth = [g for rec in dl for g in rec["shard_uss_growth_mib"]]
        added = dl[0]["shard_rows_added"]
        note = (f"- {n} entities: rebuild / delta {_x(size['rebuild_over_delta'])}. Each shard's resident memory "
                f"grew by {min(growth):.0f}-{max(growth):.0f} MiB over the delta, for {min(added):,}-{max(added):,} "
                "new rows each.")
        if "shard_uss_ready_mib" in dl[0]:  # recorded since the reloaded shards build their encoder at start
            ready = [g for rec in dl for g in rec["shard_uss_ready_mib"]]
            note += (f" Before it, untimed, each reloaded shard built its encoder once ("
                     f"{max(rec['encoder_ready_seconds'] for rec in dl):.1f} s at most, "
                     f"{min(ready):.0f}-{max(ready):.0f} MiB from its start).")
        notes.append(note)
    lines += _table(["entities", "method", "min s", "median s", "max s", "peak RSS of its process"], rows)
    return "\n".join([*lines, "", *notes, "", _run_line(data)]) + "\n"


def attention(data: dict) -> str:
    lines = [f"One thread, {data['width']} positions, bf16; q, k, v as views of one projection and a padding mask. "
             f"Median of {data['repeats']} interleaved repeats (min-max in brackets); GFLOP/s = 4 B H W^2 D over the "
             "median; the last column is the largest difference from fp32 attention of the same bf16 inputs.", ""]
    lines += _table(["shape", "method", "ms", "GFLOP/s", "speed vs sdpa", "max abs diff vs fp32"],
                    [[r["shape"], r["method"], f"{1e3 * r['median']:.2f} [{1e3 * r['min']:.2f}-{1e3 * r['max']:.2f}]",
                      f"{r['gflops']:.0f}", f"{r['x_sdpa_speed']:.2f}x", f"{r['max_abs_diff_vs_fp32']:.4f}"]
                     for r in data["alone"]])
    share = {r["attention"]: r for r in data["share"]}
    lines += ["", "Share of a MiniLM bf16 encode's CPU time spent in attention (torch.profiler, batch 16): "
              + ", ".join(f"{name} {100 * r['attention_share']:.0f}%" for name, r in share.items()) + ".", ""]
    lines += _table(["encode batch", "entities/s", "median s [min-max]"],
                    [[str(r["batch"]), f"{r['entities_per_s']:.1f}", f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"]
                     for r in data["batch_sweep"]])
    peak = data["gemm_gflops"]
    lines += ["", f"MiniLM bf16 encode with the kernel, 256 sequences, by batch size. The same run's one-thread bf16 "
              f"GEMM peak: {peak['bf16']:.0f} GFLOP/s.", _run_line(data)]
    return "\n".join(lines) + "\n"


def packed(data: dict) -> str:
    """Packed against padded towers on the CPU (benchmarks/packed.py)."""
    b = data["batch"]
    lines = [f"{data['model']}, {b['mentions']} mentions x {b['candidates']} candidates, {data['precision']}; "
             f"candidate lengths {b['lengths']}. Seconds: median [min-max] of "
             f"{next(iter(data['results'].values()))['padded']['repeats']} interleaved repeats; packed/padded: "
             "the ratio of medians [the range the spreads allow]; the last column: the largest |score "
             "difference| of one eval-mode forward over the largest |score|.", ""]
    rows = []
    for key, r in data["results"].items():
        work, lengths = key.split("/")
        rows.append([work.replace("_", " "), lengths, f"{r['real_candidate_tokens']} / {r['padded_candidate_tokens']}",
                     _ms(r["padded"], 1), _ms(r["packed"], 1), _x(r["packed_over_padded"]),
                     f"{r['eval_scores_max_abs_diff_over_max_abs']:.2g}"])
    lines += _table(["work", "lengths", "real / padded candidate tokens", "padded s", "packed s", "packed / padded",
                     "score diff"], rows)
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def _gpu_line(data: dict) -> str:
    i = data["info"]
    return (f"Run: {i.get('name', i['device'])}, torch {i['torch']}, CUDA {i.get('cuda')}, Triton {i.get('triton')}; "
            f"bf16 GEMM peak {data['peak']['tflops_best']:.0f} TFLOP/s ({data['peak']['size']}^3) in the same run; "
            f"host load average {data.get('load_average_before', float('nan')):.1f} (limit {data.get('load_limit')}).")


def gpu_mining(data: dict) -> str:
    rows = data["rows_by_batch"]
    read = data["one_read"]
    names = [("plain GEMM + topk", "plain chunked bf16 GEMM + `torch.topk` (1M-row chunks)", None),
             ("exact top-k", "exact top-k, defaults", "topk_vs_plain"),
             ("exact block Gumbel-top-k", "exact block Gumbel-top-k, defaults", "sampler_vs_plain"),
             ("exact top-k, bf16 scores", "exact top-k, `storage`/`compute: bf16` (bf16 scores)", "topk_bf16_vs_plain"),
             ("exact block Gumbel-top-k, bf16 scores", "exact block Gumbel-top-k, bf16 scores", "sampler_bf16_vs_plain"),
             ("old defaults (chunk 8192, torch), block sampler", "block sampler, old defaults (8192-row chunks, "
              "torch reductions; one timing)", None)]
    header = ["path"] + [h for r in rows for h in (f"B = {r['batch']}: ms (min-max)", "x plain")]
    table = []
    for key, label, ratio in names:
        cells = [label]
        for r in rows:
            cells += [_ms(r[key]), _x(r[ratio]) if ratio else ""]
        table.append(cells)
    table.append(["one read of the embeddings (`amax`)"] + [c for _ in rows for c in (_ms(read), "")])
    lines = [f"Mining over {data['rows']:,} x {data['dim']} bf16 random rows ({data['bytes'] / 1e9:.1f} GB), "
             f"K-1 = {data['k']}, `ShardIndex` (torch backend, `score_dtype: bf16`, `sampler: block`, every other "
             "option at its default: `device: auto`, `chunk_rows: 0`, `kernel: auto`): fp32 sums of the bf16 "
             "products, as scores; the bf16-score rows keep the GEMM's bf16 output instead, as the plain path does. "
             "Median of "
             f"{rows[0]['plain GEMM + topk']['repeats']} interleaved calls after a warm-up, results on the host.", ""]
    lines += _table(header, table)
    lines.append("")
    for r in rows:
        pc = r["ops_per_chunk"]
        lines.append(f"- B = {r['batch']}: {r['chunks']} chunks of {r['chunk_rows']:,} rows; the sampler takes "
                     f"{r['sampler_vs_one_read']:.2f}x one read of the embeddings. One call: "
                     f"{r['ops_sampler']['operators']} operators ({r['ops_topk']['operators']} for top-k), "
                     f"{r['ops_sampler']['host_syncs']} host synchronisations; each chunk more adds "
                     f"{pc['operators']:.0f} operators ({pc['operators_not_views']:.0f} that are not views or "
                     f"allocations, one Triton launch) and {pc['host_syncs']:.0f} synchronisations (torch.profiler, "
                     "the same call on half-size chunks).")
    if data.get("earlier_run"):
        lines += ["", "The same code on another H100 machine, an earlier run: "
                  + "; ".join(f"B = {r['batch']}: top-k {_ms(r['exact top-k'])} ms, sampler "
                              f"{_ms(r['exact block Gumbel-top-k'])} ms, plain {_ms(r['plain GEMM + topk'])} ms"
                              for r in data["earlier_run"]["rows"]) + "."]
    if data.get("first_version"):
        lines += ["", "The first fused version (" + data["first_version"]["note"].split(": ", 1)[1] + "), an earlier run: "
                  + "; ".join(f"B = {r['batch']}: top-k {_ms(r['exact top-k'])} ms, sampler "
                              f"{_ms(r['exact block Gumbel-top-k'])} ms, plain {_ms(r['plain GEMM + topk'])} ms"
                              for r in data["first_version"]["rows"]) + "."]
    lines += ["", f"Copy rate {data['copy_tb_per_s']:.2f} TB/s (bytes read + written); one read of the embeddings at "
              f"that rate: {1e3 * data['one_read_at_copy_rate_s']:.1f} ms.", _gpu_line(data)]
    return "\n".join(lines) + "\n"


def gpu_law(data: dict) -> str:
    ok = "passed" if data["passed"] else "FAILED"
    lines = [f"The fused path's checks on the GPU ({ok}): sharded == flat bit for bit (ids, keys, scores; pieces, "
             f"dead rows, two golds per query): {data['sharded_equals_flat']}; gold drawn: "
             f"{not data['gold_never_drawn']}; dead rows drawn: {not data['dead_never_drawn']}; duplicates: "
             f"{not data['no_duplicates']}. Against the torch path: the same sample for "
             f"{100 * data['same_sample_as_torch_path']:.1f}% of draws, top-k ids equal for "
             f"{100 * data['topk_ids_equal_torch_path']:.1f}% (scores within {data['topk_max_score_diff']:.2g}).", ""]
    lines += _table(["law test ({:,} draws, 39 rows, K-1 = 3)".format(data["draws"]), "p / z"],
                    [["first draw vs softmax (chi-square p)", f"{data['first_draw_p']:.3f}"],
                     ["ordered pairs vs successive sampling (p)", f"{data['ordered_pairs_p']:.3f}"],
                     ["the same at temperature 1.1 (must reject)", f"{data['wrong_temperature_p']:.2g}"],
                     ["inclusion probabilities, largest z-score", f"{data['inclusion_max_z']:.2f}"],
                     ["ordered pairs vs the dense sampler (two-sample p)", f"{data['vs_dense_sampler_p']:.3f}"]])
    return "\n".join(lines + ["", _gpu_line(data)]) + "\n"


def gpu_encode(data: dict) -> str:
    rows = []
    best = data["best"]
    runs = [("this run", data["variants"])] + [("first run", v) for v in [data.get("first_run", {}).get("variants")] if v]
    for label, variants in runs:
        for name, v in (variants.items() if isinstance(variants, dict) else enumerate(variants)):
            what = v["description"].split(" (the")[0]  # labels of the run's own default, stale once measured
            rows.append([what + (" (first run)" if label != "this run" else
                                 " **(the CUDA default)**" if name == best["variant"] else ""),
                         str(v["batch"]),
                         f"{v['entities_per_s']['median']:,.0f} ({v['entities_per_s']['min']:,.0f}-"
                         f"{v['entities_per_s']['max']:,.0f})", f"{100 * v['mfu']['median']:.1f}%",
                         f"{v['refresh_kilt_8gpu_min']['median']:.2f}", v["sdpa"].get("backend", "?")])
    first_num = data.get("first_run", {}).get("numerics", {})
    lines = [f"BERT-large entity encoder (dual), every row 128 tokens, {data['rows']['per_timing']:,} rows per timing, "
             "through the shard's encode path (`encode_rows`), inference; entities/s median (min-max) of "
             "interleaved rounds; MFU against the same run's bf16 GEMM peak; the 5,903,530-row KILT refresh on "
             "8 such GPUs computed from the per-GPU rate.", ""]
    lines += _table(["variant", "batch", "entities/s", "MFU", "KILT on 8 GPUs, min", "sdpa kernel"], rows)
    lines += ["", f"Best: {best['variant']} at {100 * best['mfu_median']:.1f}% of the peak; a 5.9M refresh on 8 GPUs "
              f"in {best['refresh_kilt_8gpu_min_median']:.2f} min. The shard's default on CUDA (bf16 weights, "
              "layers compiled) is that variant. Largest relative L2 distance of the reps: bf16 weights against fp32 "
              f"weights under autocast {first_num.get('bf16w_vs_autocast_rel_l2_max', float('nan')):.3f} (first run), "
              f"layers compiled against eager {data['numerics'].get('e_compiled_layers_bf16w_vs_eager_rel_l2_max', float('nan')):.3f} "
              f"(tolerance {data['numerics']['tolerance_rel_l2']:.3f}). FLOPs {data['flops'].get('formula', '')}.",
              _gpu_line(data)]
    return "\n".join(lines) + "\n"


def gpu_train(data: dict) -> str:
    rows = []
    first = data.get("first_run", {}).get("modes", {})
    modes = [(name, m) for name, m in data["modes"].items()] + [(f"{name} (first run)", m) for name, m in first.items()]
    for name, m in modes:
        if "step_seconds" not in m:
            rows.append([name, "failed: " + str(m.get("error", "?"))[:80], "", "", "", ""])
            continue
        st = m["step_seconds"]
        ph = m.get("phases_median_ms", {}).get("device_ms", {})
        conf = m.get("config")
        rows.append([name + ("" if conf in (None, "inline") else f" (`{Path(conf).name}`)"),
                     f"{1e3 * st['median']:.0f} ({1e3 * st['min']:.0f}-{1e3 * st['max']:.0f})",
                     f"{m['ratio_to_plain']:.2f}x", f"{100 * m['mfu']:.1f}%", f"{m['peak_memory_gib']:.1f}",
                     " / ".join(f"{ph.get(k, float('nan')):.0f}" for k in ("forward", "backward", "optimizer"))])
    b = data["batch"]
    lines = [f"One dual-retriever training step, BERT-base on both sides, {b['mentions']} mentions x {b['candidates']} "
             f"candidates of {b['cand_len']} tokens (mentions {b['mention_len']}), bf16, gradient clipping "
             f"{data['optim']['grad_clip']}: a plain torch step (fp32 weights, autocast, fused AdamW) against the "
             "project's `build_engine` with the DeepSpeed JSONs, same weights and batches, interleaved.", ""]
    lines += _table(["mode", "step ms (min-max)", "x plain", "MFU", "peak GiB", "forward / backward / optimizer ms"],
                    rows)
    tg = data["targets"]
    lines += ["", "Targets: " + "; ".join(f"{k} {v['ratio_to_plain']:.2f}x (limit {v['max_ratio_to_plain']}x, "
                                          f"{'met' if v['met'] else 'NOT met'}; loss within tolerance: "
                                          f"{v['losses_within_bf16_tolerance']})" for k, v in tg.items()) + ".",
              _gpu_line(data)]
    return "\n".join(lines) + "\n"


def _spread_ms(s: dict | None) -> str:
    return "-" if not s else f"{1e3 * s['median']:.0f} ({1e3 * s['min']:.0f}-{1e3 * s['max']:.0f})"


def gpu_e2e(data: dict) -> str:
    """The AIDA job end to end on one GPU (benchmarks/gpu_e2e.py)."""
    train, checks = data.get("train") or {}, data.get("checks") or {}
    steps, kb, job = train.get("steps") or {}, train.get("kb") or {}, train.get("job") or {}
    plan = (job.get("kb_snapshot") or {}).get("num_entities") or kb.get("entities")
    ds = job.get("deepspeed_config") or {}
    stage = (ds.get("zero_optimization") or {}).get("stage")
    lines = [f"`{data['config']}` submitted with `ray job submit` to a `LocalHead` on one {data.get('device_name')}: "
             f"{plan:,} synthetic KILT entities in 2 shard actors (0.25 GPU each) and one DeepSpeed worker "
             f"(0.5 GPU; ZeRO-{stage}, bf16) training both random BERT-base towers, K = 64 mixed-50, "
             f"{job.get('step')} steps of 8 mentions, the KB re-encoded at step 250 while training went on and once "
             f"more with the final weights. Step times after the first {steps.get('left_out_warm_steps')} steps; "
             "a refresh is in flight while the shards still encode a published version.", ""]
    eng = (data.get("bare_engine") or {}).get("modes") or {}
    rows = [["job step, all", _spread_ms(steps.get("step_s")), f"{steps.get('steps')} steps"],
            ["job step, no refresh in flight", _spread_ms(steps.get("step_s_no_refresh")),
             f"{(steps.get('step_s_no_refresh') or {}).get('n')} steps"],
            ["job step, refresh in flight", _spread_ms(steps.get("step_s_refresh_in_flight")),
             f"{(steps.get('step_s_refresh_in_flight') or {}).get('n')} steps"]]
    for name, label in (("engine", "bare engine step (same model, batch and DeepSpeed JSON)"),
                        ("plain", "plain torch step (fused AdamW, autocast)")):
        if "step_seconds" in eng.get(name, {}):
            m = eng[name]
            rows.append([label, _spread_ms(m["step_seconds"]),
                         f"MFU {100 * m['mfu']:.1f}%, optimizer {m['phases_median_ms']['device_ms']['optimizer']:.0f} ms"])
    lines += _table(["what", "ms median (min-max)", ""], rows)
    lines.append("")
    r = checks.get("step_ratio_to_engine")
    if r:
        lines.append(f"- Job step / bare engine step: {r['ratio']:.2f}x ({r['ratio_without_refresh_in_flight']:.2f}x "
                     f"without a refresh in flight); target <= {r['target']}x: {'met' if r['met'] else 'NOT met'}.")
    parts = steps.get("parts")
    if parts:
        what = {"compute": "forward, backward and optimizer", "mine_submit": "encoding and sending the batch P steps "
                "ahead after the optimizer step", "negatives_wait": "waiting for negatives", "batch": "batch assembly",
                "refresh_publish": "publishing weights for a refresh", "rest": "the rest"}
        enc, dev = parts.get("mine_encode"), parts.get("compute_device")
        engine_s = ((eng.get("engine") or {}).get("step_seconds") or {}).get("median")
        lines.append("- Where the job's step time goes (share of all steps' time, median ms): " + "; ".join(
            f"{what[k]} {100 * parts[k]['share']:.1f}% ({1e3 * parts[k]['median_s']:.1f}"
            + (f"; on the GPU, first kernel to last, {1e3 * dev['median_s']:.1f}" if k == "compute" and dev else "")
            + (f"; the bare engine's step {1e3 * engine_s:.1f}" if k == "compute" and engine_s else "") + ")"
            + (f", of which the mention encode {1e3 * enc['median_s']:.1f}" if k == "mine_submit" and enc else "")
            for k in ("compute", "mine_submit", "negatives_wait", "batch", "refresh_publish", "rest"))
            + ("." if enc else " (the encode's own share was not logged in this run)."))
    w = checks.get("negatives_wait_fraction")
    if w:
        lines.append(f"- The trainer's wait for negatives: {100 * w['fraction']:.2f}% of step time with a refresh in "
                     f"flight ({100 * steps['negatives_wait_fraction']:.2f}% over all steps); target < "
                     f"{100 * w['target']:.0f}%: {'met' if w['met'] else 'NOT met'}.")
    refs = train.get("refreshes") or []
    if refs:
        lines.append("- KB encodes (both shards at once; seconds of the slower shard): " + "; ".join(
            f"version {x['version']} {x['seconds']:.1f} s, {x['entities_per_s']:,.0f} entities/s, "
            f"{100 * x['mfu']:.1f}% MFU" for x in refs)
            + f" (forward FLOPs of the useful tokens, {kb.get('tokens_mean', 0):.1f} per entity on average).")
    if train.get("e2e_mfu"):
        lines.append(f"- End-to-end MFU of the training step: {100 * train['e2e_mfu']:.1f}% "
                     f"({100 * train['e2e_no_refresh_mfu']:.1f}% without a refresh in flight).")
    mem = data.get("memory") or {}
    if mem.get("peak_mib_by_role"):
        lines.append("- GPU memory, peak per process role (nvidia-smi each second; peaks at different moments): "
                     + ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in sorted(mem["peak_mib_by_role"].items()))
                     + f"; the GPU's total in use peaked at {mem['gpu_used_peak_mib'] / 1024:.1f} GiB.")
    tj = data.get("train_job") or {}
    if tj.get("seconds"):
        lines.append(f"- The train job, `ray job submit` to SUCCEEDED: {tj['seconds']:.0f} s (data generated and "
                     "prepared on first use, three KB encodes, checkpoints, export with the BLINK file).")
    for key, what in (("mining", "mining through the service against the kernel alone"),
                      ("kilt_eval", "the KILT evaluation job")):
        if key in (data.get("missing") or []):
            lines.append(f"- Not measured in this run: {what}.")
    for note in data.get("notes") or []:
        lines.append(f"- {note}")
    v = data.get("versions") or {}
    lines.append(f"Run: {data.get('device_name')}, torch {v.get('torch')}, CUDA {v.get('cuda')}; bf16 GEMM peak "
                 f"{data.get('peak_tflops', float('nan')):.0f} TFLOP/s in the same run.")
    return "\n".join(lines) + "\n"


def import_rss(data: dict) -> str:
    """BLINK's encodings imported (jobs/import_encodings.py): peak resident memory against torch.load."""
    sizes = data["sizes"]
    lines = [f"BLINK-sized float32 matrices (d = {sizes[0]['dim']}) in torch's legacy `.t7` format, converted to "
             f"float16 shard versions over {sizes[0]['shards']} shards, {data['chunk_rows']:,} rows at a time; each "
             "method in a fresh process, peak resident memory its own `VmHWM`. `torch_load` is the naive way "
             "(`torch.load`, then each shard's rows converted and saved).", ""]
    rows = []
    for size in sizes:
        for name, m in size["methods"].items():
            peak = m["peak_rss_mib"]
            rows.append([f"{size['rows']:,} x {size['dim']} ({size['matrix_bytes'] / 1e9:.1f} GB)", name,
                         f"{peak['median']:,.0f} MiB ({peak['min']:,.0f}-{peak['max']:,.0f})",
                         f"{m['start_rss_mib']:,.0f} MiB", f"{m['peak_over_shard_bytes']:.2f}",
                         f"{m['seconds']['median']:.1f} ({m['seconds']['min']:.1f}-{m['seconds']['max']:.1f})",
                         str(m["seconds"]["repeats"])])
    lines += _table(["matrix", "method", "peak RSS, median (min-max)", "RSS after imports",
                     "peak / one shard's float16 bytes", "seconds, median (min-max)", "runs"], rows)
    full = [s for s in sizes if "torch_load" not in s["methods"]]
    if full:
        f = full[0]
        need = (f["matrix_bytes"] + f["shard_float16_bytes"]) / 2**30
        lines += ["", f"`torch_load` is not run at {f['rows']:,} rows: it would hold the whole "
                      f"{f['matrix_bytes'] / 2**30:.1f} GiB matrix and a shard's float16 copy ({need:.1f} GiB) on a "
                      f"machine of {data['machine']['ram_gib']} GiB."]
    lines += ["", _run_line(data)]
    if "model" in data:
        lines += ["", *_import_model(data["model"], sizes[-1])]
    return "\n".join(lines) + "\n"


def _import_model(model: dict, size: dict) -> list[str]:
    """The import's model step (``--model biencoder.bin``) beside its matrix step at ``size``'s rows."""
    c = model["config"]
    name = f"2 towers x {c['num_hidden_layers']} layers, d = {c['hidden_size']} ({model['file_bytes'] / 1e9:.2f} GB)"
    lines = [f"The import's other step, the model it fingerprints (`--model biencoder.bin`): a BLINK-layout biencoder "
             f"of random weights, {model['params'] / 1e6:,.0f}M fp32 parameters (`--model-shape {model['shape']}`), "
             "each way in a fresh process, interleaved. `load` builds the retriever (both towers) and hashes its "
             "entity encoder, as the import did before; `stream` maps the file and hashes the entity tower a tensor "
             "at a time (`dist_nce/modeling/blink_stream.py`), what it does now. "
             + ("Both gave the same fingerprint." if model["fingerprints_equal"] else "THE FINGERPRINTS DIFFERED."), ""]
    rows = []
    for method, m in model["methods"].items():
        peak, sec = m["peak_rss_mib"], m["seconds"]
        rows.append([name, method, f"{peak['median']:,.0f} MiB ({peak['min']:,.0f}-{peak['max']:,.0f})",
                     f"{m['start_rss_mib']:,.0f} MiB", f"{m['peak_over_file_bytes']:.2f}",
                     f"{sec['median']:.1f} ({sec['min']:.1f}-{sec['max']:.1f})", str(sec["repeats"])])
    lines += _table(["model .bin", "method", "peak RSS, median (min-max)", "RSS before it", "peak / .bin bytes",
                     "seconds, median (min-max)", "runs"], rows)
    matrix = size["methods"]["stream"]["peak_rss_mib"]["median"]
    load = model["methods"]["load"]["peak_rss_mib"]["median"]
    stream = model["methods"]["stream"]["peak_rss_mib"]["median"]
    def step(model_peak: float) -> str:
        return f"{max(model_peak, matrix):,.0f} MiB, the {'model' if model_peak > matrix else 'matrix'} step's"

    grew = {m: r["peak_rss_mib"]["median"] - r["start_rss_mib"] for m, r in model["methods"].items()}
    lines += ["", f"An import runs the two steps one after the other, so its peak is the larger of the two. With "
                  f"{size['rows']:,} rows, whose matrix step peaks at {matrix:,.0f} MiB: {step(load)} when the model "
                  f"was loaded whole (the model step {load / matrix:.1f}x the matrix step), {step(stream)} with the "
                  f"model fingerprinted off the file ({stream / matrix:.1f}x). Above what the process held before "
                  f"the model step (interpreter, torch, transformers), the model took {grew['load']:,.0f} MiB, now "
                  f"{grew['stream']:,.0f} MiB.",
              "", _run_line(model).replace("Run:", "Run (model step):", 1)]
    return lines


def monitor(data: dict) -> str:
    """The live bias monitor's shard work on SOM, before and after it shared its scoring."""
    c = data["config"]
    lines = [f"One measurement of the live bias monitor on SOM: {c['probe']} probe mentions x {c['draws']} draws "
             f"(K = {c['k']}) against {c['entities']:,} entities of {c['columns']} columns x {c['dim']}, one thread. "
             "`before`: every query row scored and the gradients by autograd; `after`: the draws of a probe "
             "mention share one scoring pass and the gradients are in closed form. Median (min-max) of "
             f"{c['repeats']} interleaved calls. The share of training time is the committed mini paper's "
             "`bias/cost` (median over its 3 seeds), and that share times the measured ratio: a projection, "
             "not a rerun of the training.", ""]
    rows = []
    for r in data["rows"]:
        before, after = data["methods"][f"{r['arm']} before"], data["methods"][f"{r['arm']} after"]
        apart = "" if r["distinct"] else " (overlap)"
        rows.append([r["arm"], f"{before['median']:.3f} ({before['min']:.3f}-{before['max']:.3f})",
                     f"{after['median']:.3f} ({after['min']:.3f}-{after['max']:.3f})",
                     f"{r['x_median']:.2f}x [{r['x_low']:.2f}-{r['x_high']:.2f}]{apart}",
                     f"{100 * r['committed_share']:.1f}%", f"{100 * r['projected_share']:.1f}%"])
    lines += _table(["arm", "before: s", "after: s", "after / before", "share of training then",
                     "projected share"], rows)
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def som_grid(data: dict) -> str:
    """SOM's exact search on the old 8192-row CPU grid and on the grid scaled by the vectors per row."""
    c = data["config"]
    lines = [f"SOM's exact search with MiniLM's shapes ({c['columns']} token vectors of {c['dim']} per entity and "
             "per mention), one thread. `then`: the old CPU auto grid of 8192 rows, which a shard's partial block "
             "is zero-padded to and scored whole; `now`: the auto grid divided by the vectors per row. `eval world`: "
             "a batch's exact top-64 in one world; `train KB`: a training step's hard negatives by the exact "
             f"Gumbel-top-k (block sampler). Median (min-max) of {c['repeats']} interleaved calls; `same ids`: the "
             "share of returned ids equal on the two grids.", ""]
    rows = []
    for r in data["rows"]:
        then, now = data["methods"][f"{r['workload']} before"], data["methods"][f"{r['workload']} after"]
        apart = "" if r["distinct"] else " (overlap)"
        rows.append([r["workload"], f"{r['entities']:,}", str(r["batch"]), f"{r['grid_before']} / {r['grid_after']}",
                     f"{then['median']:.3f} ({then['min']:.3f}-{then['max']:.3f})",
                     f"{now['median']:.3f} ({now['min']:.3f}-{now['max']:.3f})",
                     f"{r['x_median']:.3f}x [{r['x_low']:.3f}-{r['x_high']:.3f}]{apart}",
                     f"{r['mentions_per_s_before']:.1f} / {r['mentions_per_s_after']:.1f}", f"{r['same_ids']:.4f}"])
    lines += _table(["workload", "entities", "mentions", "grid rows then / now", "then: s", "now: s", "now / then",
                     "mentions/s then / now", "same ids"], rows)
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


def ray_start(data: dict) -> str:
    """An actor's start on a local Ray: the workers' settings in the node's environment or in the job's runtime env."""
    names = {"node_env": "settings in the node's environment (`init_ray`)",
             "runtime_env": "the same settings as the job's runtime env"}
    lines = [f"{data['actors']} trivial actors on a fresh local Ray (`num_cpus=0`), {data['rounds']} rounds, the two "
             "ways alternating, each in a new process. Seconds from the first creation to the last answer and CPU "
             "seconds per actor process (user + system, Ray's `setup_worker.py` included); median (min-max).", ""]
    rows = [[names[m], f"{data['methods'][m]['start_s']['median']:.2f} ({data['methods'][m]['start_s']['min']:.2f}-"
                       f"{data['methods'][m]['start_s']['max']:.2f})",
             f"{data['methods'][m]['cpu_s_per_actor']['median']:.2f} ({data['methods'][m]['cpu_s_per_actor']['min']:.2f}-"
             f"{data['methods'][m]['cpu_s_per_actor']['max']:.2f})"] for m in ("node_env", "runtime_env")]
    c = data["methods"]["compare"]
    rows.append(["node / runtime env", *(f"{c[k]['x_median']:.2f}x" + ("" if c[k]["distinct"] else " (overlap)")
                                         for k in ("start_s", "cpu_s_per_actor"))])
    lines += _table(["actors started with", "start s", "CPU s per actor"], rows)
    return "\n".join([*lines, "", _run_line(data)]) + "\n"


RENDERERS: dict[str, Callable[[dict], str]] = {"mining": mining, "scale": scale, "refresh": refresh,
                                                "train_step": train_step, "link": link,
                                                "scoring": scoring, "search": search, "ingest": ingest,
                                                "update": update, "attention": attention,
                                                "gpu_mining": gpu_mining, "gpu_law": gpu_law,
                                                "gpu_encode": gpu_encode, "gpu_train": gpu_train,
                                                "gpu_e2e": gpu_e2e,
                                                "import_rss": import_rss, "monitor": monitor,
                                                "som_grid": som_grid, "serve_load": serve_load,
                                                "packed": packed, "ray_start": ray_start}


def sources(name: str) -> tuple[str, ...]:
    """The result files behind page block ``name``."""
    return ("mining", "scale", "refresh", "train_step") if name == "targets" else (name,)


def render(name: str, results: Path = RESULTS) -> str:
    if name == "targets":
        return targets(results)
    if name not in RENDERERS:
        raise KeyError(f"docs/benchmarks.md: bench block '{name}' has no renderer in benchmarks/report.py "
                       f"(known: targets, {', '.join(sorted(RENDERERS))})")
    return RENDERERS[name](_load(results, name))


# Pages that carry copies of some of the page's blocks beside their own prose, and the blocks each must
# carry (the page itself must carry every block). The README carries none, but one it gains is checked too.
COPIES = {"docs/gpu.md": ("gpu_mining", "gpu_e2e", "packed"), "docs/real_data.md": ("import_rss",), "docs/linking.md": ("serve_load",),
          "README.md": ()}


def rewrite(text: str, results: Path = RESULTS) -> str:
    """``text`` with every bench block re-rendered from ``results``."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name"), results) + m.group(4), text)


def blocks(text: str) -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}


def names() -> list[str]:
    """Every block the page must show: the targets and one per renderer (one per result file)."""
    return ["targets", *RENDERERS]


def stale_blocks(text: str, results: Path = RESULTS) -> list[str]:
    """Blocks of ``text`` that differ from what ``results`` renders, and required blocks it lacks."""
    found, fresh = blocks(text), blocks(rewrite(text, results))
    return [n for n, body in found.items() if fresh[n] != body] + [f"{n} (missing)" for n in names()
                                                                      if n not in found]


def stale_copies(results: Path = RESULTS, copies: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """``"FILE NAME"`` for each block of a COPIES page (a path relative to the repository, or absolute)
    that differs from what ``results`` renders, and ``"FILE NAME (missing)"`` for each block a page must
    carry and lacks."""
    stale = []
    for rel, required in (COPIES if copies is None else copies).items():
        text = (REPO / rel).read_text(encoding="utf-8")
        found, fresh = blocks(text), blocks(rewrite(text, results))
        stale += [f"{rel} {n}" for n, body in found.items() if fresh[n] != body]
        stale += [f"{rel} {n} (missing)" for n in required if n not in found]
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a block of docs/benchmarks.md or of a COPIES page differs from its JSON "
                         "or is missing")
    args = ap.parse_args(argv)
    page = PAGE.relative_to(REPO)
    text = PAGE.read_text(encoding="utf-8")
    if args.check:
        stale = stale_blocks(text) + stale_copies()
        print("stale benchmark blocks: " + ", ".join(stale) if stale
              else f"{page} and {', '.join(COPIES)}: benchmark blocks match the JSON")
        return 1 if stale else 0
    new = rewrite(text)
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
    copied = []
    for rel in COPIES:
        path = REPO / rel
        old = path.read_text(encoding="utf-8")
        fresh = rewrite(old)
        if fresh != old:
            path.write_text(fresh, encoding="utf-8")
        copied.append(f"{rel}: {', '.join(blocks(fresh)) or 'none'}")
    missing = [n for n in names() if n not in blocks(new)] + [s for s in stale_copies() if s.endswith("(missing)")]
    print(f"rendered {len(blocks(new))} blocks of {page}: {', '.join(blocks(new))}; " + "; ".join(copied)
          + (f"; no block for {', '.join(missing)}: add a <!-- bench:NAME --> pair" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
