"""Peak resident memory of importing BLINK-sized entity encodings: streamed against torch.load.

BLINK's ``all_entities_large.t7`` is one float32 tensor, 5,903,527 x 1024 (24.2 GB), saved in
torch's legacy format. Each method runs in a fresh child process that reports its own peak
resident set (``VmHWM``) and seconds, converting the matrix to float16 shard versions:

* ``stream``: ``dist_nce.index.import_encodings.import_matrix`` (what jobs/import_encodings.py
  runs): positioned reads of ``--chunk-rows`` rows, converted and appended to each shard's file;
* ``torch_load``: the naive way, ``torch.load(weights_only=True)`` then each shard's rows
  converted and saved with ``PersistedVersions.save``.

Sizes: ``--small-rows`` (default 1/8 of BLINK's rows), where both run, interleaved and
repeated; and ``--full-rows`` (default all of BLINK's), where only ``stream`` runs once: the
naive load alone needs the whole 24.2 GB matrix resident, more than this machine's RAM. The
matrix files are real legacy-format ``torch.save`` files written from a sparse file's
mapping (zeros: the bytes do not change the memory a reader needs); they are deleted after.

The import's other step is the model (``--model biencoder.bin``): only its entity encoder's
fingerprint is needed. The ``model`` part writes a BLINK-layout biencoder of random weights
(``--model-shape large``: two BERT-large towers, 2.68 GB, ``biencoder_wiki_large.bin``'s size)
and fingerprints it the import's two ways, each in a fresh process, interleaved:

* ``load``: the retriever built from the file, its entity state hashed (the import until now);
* ``stream``: ``dist_nce.index.import_encodings.blink_source_model``, the file mapped and the
  entity tower hashed a tensor at a time (what jobs/import_encodings.py runs now).

Both must give the same fingerprint (checked, recorded). ``--parts`` runs some parts only; the
parts not run are kept from the ``--out`` file when it exists, each part with its own run line
(load average, machine), so the JSON always says when each figure was measured.

    .venv/bin/python -m benchmarks.import_rss                       # all (needs ~43 GB of disk)
    .venv/bin/python -m benchmarks.import_rss --parts model         # the model part only (2.7 GB of disk)
    .venv/bin/python -m benchmarks.import_rss --small-rows 20000 --full-rows 0 --repeats 1 \
        --model-shape tiny --out /tmp/r.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, load_guard, machine_info, print_table, save_results, spread

BLINK_ROWS, BLINK_DIM = 5_903_527, 1024
ROOT = Path(__file__).resolve().parents[1]
# BertModel configs: bert-large-uncased's (biencoder_wiki_large.bin holds two), and a tiny one for tests
MODEL_SHAPES = {
    "large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 1, "intermediate_size": 96},
}
PARTS = ("matrix", "model")


def write_legacy_matrix(path: Path, rows: int, dim: int) -> None:
    """A legacy-format torch.save of a float32 [rows, dim] tensor of zeros, without holding it:
    the storage maps a sparse file (private mapping: pages are read as they are written out)."""
    sparse = path.with_suffix(".sparse")
    with open(sparse, "wb") as f:
        f.truncate(rows * dim * 4)
    storage = torch.UntypedStorage.from_file(str(sparse), shared=False, nbytes=rows * dim * 4)
    tensor = torch.empty(0).set_(storage, 0, (rows, dim), (dim, 1))
    torch.save(tensor, path, _use_new_zipfile_serialization=False)
    del tensor, storage
    sparse.unlink()


def write_blink_biencoder(path: Path, shape: str, seed: int = 0) -> dict:
    """A zip-format ``torch.save`` of BLINK's biencoder layout (``context_encoder.bert_model.*``,
    ``cand_encoder.bert_model.*``, transformers' BertModel names, pooler included) with random
    N(0, 0.02) weights of ``MODEL_SHAPES[shape]``; returns the BertConfig dict and the parameter count."""
    from dist_nce.modeling.encoder import transformer_from_config

    config = {"model_type": "bert", "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
              **MODEL_SHAPES[shape]}
    with torch.device("meta"):  # the names and shapes only
        names = {k: v.shape for k, v in transformer_from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {f"{side}.bert_model.{k}": torch.empty(size).normal_(0, 0.02, generator=gen)
             for side in ("context_encoder", "cand_encoder") for k, size in names.items()}
    torch.save(state, path)
    return {"config": config, "params": sum(v.numel() for v in state.values())}


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(method: str, matrix_path: str, out: str, shards: int, chunk_rows: int) -> dict:
    """Run one method in this (fresh) process; returns seconds and peak RSS."""
    from dist_nce.actors.service import even_ranges
    from dist_nce.index.import_encodings import ImportTarget, import_matrix
    from dist_nce.index.matrix_file import open_matrix
    from dist_nce.index.versions import PersistedVersions, shard_dir_name, shard_identity
    from dist_nce.modeling.scoring import Reps, ScoreSpec

    base = peak_rss_mib()
    t0 = time.perf_counter()
    matrix = open_matrix(matrix_path)
    target = ImportTarget(Path(out), even_ranges(matrix.rows, shards), "bench", dataclasses.asdict(
        ScoreSpec.preset("dual")), "float16", "bench")
    if method == "stream":
        import_matrix(matrix, None, target, chunk_rows=chunk_rows)
    else:
        full = torch.load(matrix_path, weights_only=True)
        for i, rows in enumerate(target.ranges):
            versions = PersistedVersions(target.shard_root / shard_dir_name(i, shards), shard_identity(
                rows, "bench", target.spec, "float16", matrix.dim))
            versions.save(0, Reps(full[rows[0]:rows[1]].half(), None), encoder_fingerprint="bench")
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(), "start_rss_mib": base}


def model_child(method: str, model_path: str) -> dict:
    """Fingerprint the model at ``model_path`` the ``method`` way in this (fresh) process."""
    from transformers import BertModel  # noqa: F401 - both ways import it: not part of either's peak

    from dist_nce.index.import_encodings import blink_source_model, loaded_source_model
    from dist_nce.modeling.resolve import load_retriever
    from dist_nce.modeling.retriever import RetrieverConfig

    base = peak_rss_mib()
    t0 = time.perf_counter()
    if method == "model_load":
        model = loaded_source_model(load_retriever(model_path))
    else:
        model = blink_source_model(model_path, RetrieverConfig())
        if model is None:
            raise RuntimeError(f"{model_path}: not streamable")
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(), "start_rss_mib": base,
            "fingerprint": model.encoder_fingerprint}


def run_child(method: str, matrix: Path, work: Path, shards: int, chunk_rows: int) -> dict:
    out = work / f"out_{method}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "benchmarks.import_rss", "--child", method, "--matrix", str(matrix),
           "--child-out", str(out), "--shards", str(shards), "--chunk-rows", str(chunk_rows)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise RuntimeError(f"{method}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(rows: int, methods: list[str], repeats: int, work: Path, shards: int, chunk_rows: int) -> dict:
    matrix = work / f"all_entities_{rows}.t7"
    t0 = time.perf_counter()
    write_legacy_matrix(matrix, rows, BLINK_DIM)
    made = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        for _ in range(repeats):
            for m in methods:  # interleaved
                runs[m].append(run_child(m, matrix, work, shards, chunk_rows))
    finally:
        matrix.unlink(missing_ok=True)
    shard_bytes = -(-rows // shards) * BLINK_DIM * 2
    out = {"rows": rows, "dim": BLINK_DIM, "matrix_bytes": rows * BLINK_DIM * 4, "shards": shards,
           "shard_float16_bytes": shard_bytes, "write_matrix_seconds": round(made, 1), "methods": {}}
    for m, rs in runs.items():
        peaks = [r["peak_rss_mib"] for r in rs]
        out["methods"][m] = {"peak_rss_mib": spread(peaks), "seconds": spread([r["seconds"] for r in rs]),
                             "start_rss_mib": rs[0]["start_rss_mib"],
                             "peak_over_shard_bytes": max(peaks) * 2 ** 20 / shard_bytes}
    return out


def measure_model(shape: str, repeats: int, work: Path) -> dict:
    """Write a BLINK biencoder of ``shape``, fingerprint it both ways ``repeats`` times interleaved."""
    path = work / f"biencoder_{shape}.bin"
    t0 = time.perf_counter()
    made = write_blink_biencoder(path, shape)
    made["write_seconds"] = round(time.perf_counter() - t0, 1)
    runs: dict[str, list[dict]] = {"model_load": [], "model_stream": []}
    try:
        file_bytes = path.stat().st_size
        for _ in range(repeats):
            for m in runs:
                runs[m].append(run_child(m, path, work, 0, 0))
    finally:
        path.unlink(missing_ok=True)
    prints = {r["fingerprint"] for rs in runs.values() for r in rs}
    if len(prints) != 1:
        raise RuntimeError(f"the two ways gave different fingerprints: {sorted(prints)}")
    methods = {}
    for m, rs in runs.items():
        peaks = [r["peak_rss_mib"] for r in rs]
        methods[m.removeprefix("model_")] = {
            "peak_rss_mib": spread(peaks), "seconds": spread([r["seconds"] for r in rs]),
            "start_rss_mib": rs[0]["start_rss_mib"], "peak_over_file_bytes": max(peaks) * 2 ** 20 / file_bytes}
    return {"shape": shape, **made, "file_bytes": file_bytes, "fingerprints_equal": True, "methods": methods}


def _previous(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-rows", type=int, default=BLINK_ROWS // 8)
    ap.add_argument("--full-rows", type=int, default=BLINK_ROWS, help="0: skip the full size")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--chunk-rows", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="directory for the matrix files (default: a temporary one)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--force", action="store_true", help="record even on a busy machine (marked noisy)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {PARTS}; the others are kept from --out")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="large")
    ap.add_argument("--model-repeats", type=int, default=3)
    ap.add_argument("--child", choices=["stream", "torch_load", "model_load", "model_stream"], help=argparse.SUPPRESS)
    ap.add_argument("--matrix", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = model_child(args.child, args.matrix) if args.child.startswith("model_") else \
            child(args.child, args.matrix, args.child_out, args.shards, args.chunk_rows)
        print(json.dumps(result))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts: {args.parts!r}; expected some of {','.join(PARTS)}")
    out = Path(args.out) if args.out else RESULTS_DIR / "import_rss.json"
    payload = {k: v for k, v in _previous(out).items() if k in ("sizes", "chunk_rows", "load_average_before",
                                                                "load_limit", "noisy", "machine", "model")}
    guard = load_guard(args.force)
    work = Path(args.work or tempfile.mkdtemp(prefix="import_rss_"))
    work.mkdir(parents=True, exist_ok=True)
    if "matrix" in parts:
        sizes = [measure(args.small_rows, ["stream", "torch_load"], args.repeats, work, args.shards,
                         args.chunk_rows)]
        if args.full_rows:
            sizes.append(measure(args.full_rows, ["stream"], 1, work, args.shards, args.chunk_rows))
        payload.update(sizes=sizes, chunk_rows=args.chunk_rows, **guard, machine=machine_info())
        rows = [{"rows": s["rows"], "gb": s["matrix_bytes"] / 1e9, "method": m, "peak": r["peak_rss_mib"]["max"],
                 "x": r["peak_over_shard_bytes"], "s": r["seconds"]["median"]}
                for s in sizes for m, r in s["methods"].items()]
        print_table(rows, [("rows", "rows", ">10d"), ("gb", "matrix GB", ">9.1f"), ("method", "method", "<11s"),
                           ("peak", "peak RSS MiB (max)", ">18.0f"), ("x", "x one shard fp16", ">16.2f"),
                           ("s", "seconds (median)", ">16.1f")])
    if "model" in parts:
        guard = load_guard(args.force)  # this part's own start
        model = measure_model(args.model_shape, args.model_repeats, work)
        payload["model"] = {**model, **guard, "machine": machine_info()}
        print_table([{"method": m, "gb": model["file_bytes"] / 1e9, "peak": r["peak_rss_mib"]["max"],
                      "x": r["peak_over_file_bytes"], "s": r["seconds"]["median"]}
                     for m, r in model["methods"].items()],
                    [("method", "model", "<7s"), ("gb", ".bin GB", ">7.2f"), ("peak", "peak RSS MiB (max)", ">18.0f"),
                     ("x", "x .bin bytes", ">12.2f"), ("s", "seconds (median)", ">16.1f")])
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    missing = [p for p in PARTS if (p == "matrix" and "sizes" not in payload) or (p == "model" and p not in payload)]
    if missing:
        print(f"note: no {', '.join(missing)} part in {out} (not run now, none kept)")
    path = save_results("import_rss", {"benchmark": "import_rss", **payload}, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
