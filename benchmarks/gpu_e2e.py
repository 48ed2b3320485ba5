"""The AIDA job end to end on one GPU, as users run it, timed against its parts (issue 35).

1. A random BERT-base in Hugging Face layout (bert-base-uncased's shapes and dropout, the MiniLM
   tokenizer, seed 0: no weights are downloaded on the GPU machine) as both towers.
2. With the GPU to itself: the bare engine step of the same model and batch
   (:func:`benchmarks.gpu_train.run` with the job's DeepSpeed JSON: B = 8 mentions x K = 64
   candidates, 32 / 128 tokens), against a plain torch step.
3. A head started the project's way (:class:`~dist_nce.cluster.head.LocalHead`: ``ray start --head`` on
   loopback with token authentication), then ``ray job submit --working-dir . -- python
   jobs/aida_finetune.py --config configs/aida/one_gpu_dual_p50.yaml`` with absolute data and run paths:
   synthetic KILT KB (1M entities) -> prepared store -> 2 GPU shard actors (0.25 GPU each) encode index
   version 0 -> one DeepSpeed worker under Ray Train (0.5 GPU) trains both towers with mixed-50
   negatives, the KB re-encoded every 250 steps while training goes on (refresh async) -> dev
   evaluation before and after -> checkpoint, export (Hugging Face + BLINK layout, KB snapshot).
4. On the same head after the job: one mining call through the NegativeService (Ray call, the
   shards' searches, the merge) against the kernel alone (one ShardIndex over all rows, in a driver
   process of its own), interleaved and repeated.
5. ``ray job submit -- python jobs/evaluate_kilt_aida.py`` on the exported model: KILT guess files
   and scores over the whole KB, reusing the shards' persisted encoding of the final weights.

``--stages`` runs a part (a GPU call's 10 minutes hold the train job, a second call on the same warm
machine the rest: scripts/device_e2e.sh); ``--assemble`` makes one JSON of the calls' JSONs and the
run's files.

While the jobs run, ``nvidia-smi`` is sampled every second: GPU memory per process (shards, the Train
worker, others), named from each process's title. From the run's own files: the step times
(``metrics.jsonl``), with and without a refresh in flight; the trainer's wait for negatives; each
refresh's encode seconds per shard (the versions' manifests) and its MFU; the end-to-end MFU.

    python -m benchmarks.gpu_e2e                        # on a GPU: benchmarks/results/gpu_e2e.json
    python -m benchmarks.gpu_e2e --tiny --out /tmp/e2e.json   # a CPU rehearsal (tests/benchmarks)

Every stage writes the JSON again, so a run cut short keeps what it measured; a failing stage is
recorded with its error and the later stages that do not need it still run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/aida/one_gpu_dual_p50.yaml"
TARGETS = {"step_ratio_to_engine": 1.15, "negatives_wait_fraction": 0.02}
STAGES = ("bare_engine", "train", "mining", "kilt_eval")
WARM_STEPS = 10  # steps left out of the step-time figures: compile, allocator and cache warm-up
# The parts of a logged step (dist_nce/train/loop.py train_step), in order; together they are the step
# but for the bookkeeping between them. mine_submit: encoding the mentions of the batch P steps ahead
# and sending them to the shards, after the optimizer step; time/mine_encode_s (logged since this split)
# is the encode's share of it, so it is reported beside the parts, not as one of them; so is
# time/compute_device_s (logged on CUDA since it was added: the GPU's wall time from compute's first kernel
# to its last, dist_nce/worker/device_time.py): compute's host clock stops when the optimizer's kernels are
# queued, and what is left of them is waited for in mine_submit.
STEP_PARTS = {"refresh_publish": "time/refresh_s", "negatives_wait": "time/negatives_wait_s",
              "batch": "time/batch_s", "compute": "time/compute_s", "mine_submit": "time/mine_submit_s"}
# The CPU rehearsal: the same config at tiny size (tiny BERT, 3,000 entities, shards and worker on CPUs).
TINY_SETS = [
    "data.synthetic_entities=3000", "data.synthetic_train=160", "data.synthetic_dev=40", "data.synthetic_test=10",
    "data.entity_max_len=32", "data.mention_max_len=16", "data.prepare_workers=1",
    "negatives.num_candidates=8", "refresh.every_steps=8", "optim.max_steps=16", "optim.batch_size=4",
    "service.num_gpus=0", "service.num_cpus=0.5", "service.threads=1", "service.encode_batch_size=64",
    "service.encode_dtype=auto", "service.encode_weights=auto", "service.index.score_dtype=fp32",
    "run.use_gpu=false", "run.gpus_per_worker=0", "run.cpus_per_worker=1", "run.checkpoint_every_steps=8",
    "run.eval_k=[1,4,8]", "run.eval_batch_size=32", "deepspeed.config=configs/deepspeed/zero0_fp32.json",
]


# --------------------------------------------------------------------------- pure analysis


def encoder_flops(matmul_params: int, layers: int, hidden: int, lengths: list[int] | Any) -> float:
    """Forward FLOPs of a transformer over sequences of ``lengths`` tokens: 2 x matmul params per token
    plus attention's two T x T x d products per layer (4 L T^2 d). Padding is not counted."""
    total = 0.0
    for t in lengths:
        total += 2.0 * matmul_params * t + 4.0 * layers * t * t * hidden
    return total


def step_records(lines: list[dict], warm: int = WARM_STEPS) -> dict[str, Any]:
    """Step-time figures from ``metrics.jsonl`` records (one per step, ``log_every_steps`` 1).

    A refresh is in flight at a step when the index version its negatives came from is older than the
    newest version published (``index/published > index/version``: the shards are still encoding).
    The first ``warm`` steps are left out of every figure."""
    steps = [r for r in lines if "time/step_s" in r and r.get("step", 0) >= warm]
    if not steps:
        return {"steps": 0}

    def spread(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values),
                "mean": statistics.fmean(values)}

    in_flight = [r for r in steps if r.get("index/published", -1) > r.get("index/version", -1) >= 0]
    quiet = [r for r in steps if not (r.get("index/published", -1) > r.get("index/version", -1) >= 0)]
    total = sum(r["time/step_s"] for r in steps)
    wait = sum(r.get("time/negatives_wait_s", 0.0) for r in steps)
    wait_flight = sum(r.get("time/negatives_wait_s", 0.0) for r in in_flight)
    return {
        "steps": len(steps), "left_out_warm_steps": warm,
        "step_s": spread([r["time/step_s"] for r in steps]),
        "step_s_refresh_in_flight": spread([r["time/step_s"] for r in in_flight]),
        "step_s_no_refresh": spread([r["time/step_s"] for r in quiet]),
        "compute_s": spread([r["time/compute_s"] for r in steps if "time/compute_s" in r]),
        "negatives_wait_s": spread([r.get("time/negatives_wait_s", 0.0) for r in steps]),
        "negatives_wait_fraction": wait / total if total else None,
        "negatives_wait_fraction_refresh_in_flight": (
            wait_flight / sum(r["time/step_s"] for r in in_flight) if in_flight else None),
        "refresh_publish_s": spread([r["time/refresh_s"] for r in steps if r.get("time/refresh_s", 0) > 1e-3]),
        "refresh_wait_s_total": sum(r.get("time/refresh_wait_s", 0.0) for r in steps),
        "versions_seen": sorted({int(r["index/version"]) for r in steps if "index/version" in r}),
        "parts": step_parts(steps),
    }


def step_parts(steps: list[dict]) -> dict[str, Any] | None:
    """Where the steps' time went: each part of :data:`STEP_PARTS` as a share of the summed step time and
    its median seconds, ``rest`` what no part holds, and, where every step logged them, ``mine_encode``
    (the mention encode inside mine_submit) and ``compute_device`` (the GPU's wall time for compute's
    kernels, which may run past compute's host clock into mine_submit). Steps logged without every part
    (an older run) are left out."""
    full = [r for r in steps if all(k in r for k in STEP_PARTS.values())]
    total = sum(r["time/step_s"] for r in full)
    if not full or total <= 0:
        return None
    out: dict[str, Any] = {"steps": len(full)}
    for name, key in STEP_PARTS.items():
        out[name] = {"share": sum(r[key] for r in full) / total, "median_s": statistics.median(r[key] for r in full)}
    rest = [r["time/step_s"] - sum(r[k] for k in STEP_PARTS.values()) for r in full]
    out["rest"] = {"share": sum(rest) / total, "median_s": statistics.median(rest)}
    for name, key in (("mine_encode", "time/mine_encode_s"), ("compute_device", "time/compute_device_s")):
        beside = [r[key] for r in full if key in r]
        out[name] = ({"share": sum(beside) / total, "median_s": statistics.median(beside)}
                     if len(beside) == len(full) else None)
    return out


def refresh_records(shard_dir: Path) -> list[dict[str, Any]]:
    """Each persisted index version: its shards' rows and encode seconds (the versions' manifests)."""
    by_version: dict[int, list[dict]] = {}
    for manifest in sorted(shard_dir.glob("shard-*/v*/manifest.json")):
        m = json.loads(manifest.read_text())
        version = int(manifest.parent.name.lstrip("v"))
        rows = int((m.get("shape") or [0])[0])
        by_version.setdefault(version, []).append({"shard": manifest.parent.parent.name, "rows": rows,
                                                   "encode_seconds": m.get("encode_seconds"),
                                                   "device": m.get("device"), "encode_dtype": m.get("encode_dtype")})
    out = []
    for version, shards in sorted(by_version.items()):
        secs = [s["encode_seconds"] for s in shards if s["encode_seconds"] is not None]
        rows = sum(s["rows"] for s in shards)
        out.append({"version": version, "rows": rows, "shards": shards,
                    "seconds": max(secs) if secs else None,  # the shards encode in parallel
                    "entities_per_s": rows / max(secs) if secs else None})
    return out


# --------------------------------------------------------------------------- the GPU's memory


class GpuMemory(threading.Thread):
    """``nvidia-smi`` every ``interval`` seconds: the most memory each role's processes held (shards,
    Train worker, others, by process title) and the GPU's total in use. No nvidia-smi: nothing."""

    ROLES = (("EntityShard", "shards"), ("RayTrainWorker", "train_worker"), ("TrainController", "controller"))

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.stop_event = interval, threading.Event()
        self.peak_mib: dict[str, float] = {}
        self.total_peak_mib = 0.0
        self.samples = 0
        self.error: str | None = None

    def _role(self, pid: str) -> str:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "unknown"
        return next((role for key, role in self.ROLES if key in title), "other")

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout
                used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired) as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            now: dict[str, float] = {}
            for line in apps.strip().splitlines():
                pid, _, mib = (x.strip() for x in line.partition(","))
                if mib.replace(".", "").isdigit():
                    role = self._role(pid)
                    now[role] = now.get(role, 0.0) + float(mib)
            for role, mib in now.items():
                self.peak_mib[role] = max(self.peak_mib.get(role, 0.0), mib)
            if used.strip().split("\n")[0].strip().replace(".", "").isdigit():
                self.total_peak_mib = max(self.total_peak_mib, float(used.strip().split("\n")[0]))
            self.samples += 1

    def result(self) -> dict[str, Any]:
        self.stop_event.set()
        return {"peak_mib_by_role": self.peak_mib, "gpu_used_peak_mib": self.total_peak_mib,
                "samples": self.samples, "error": self.error,
                "how": "nvidia-smi every second: per-process used_memory summed by process title; peaks"}


# --------------------------------------------------------------------------- stages


class Run:
    """The result dict, written atomically after every stage."""

    def __init__(self, out: Path, payload: dict[str, Any]):
        self.out, self.payload = out, payload

    def save(self) -> None:
        from benchmarks.common import save_results

        save_results("gpu_e2e", self.payload, self.out)

    def stage(self, name: str, fn: Callable[[], Any], key: str | None = None) -> Any:
        """``fn()``, timed and recorded under ``stages``; its value also under ``key`` before the save."""
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            value = fn()
            self.payload.setdefault("stages", {})[name] = {"seconds": round(time.perf_counter() - t0, 2), "ok": True}
            if key is not None:
                self.payload[key] = value
            return value
        except Exception as e:  # noqa: BLE001 - recorded; later stages that do not need this one go on
            self.payload.setdefault("stages", {})[name] = {
                "seconds": round(time.perf_counter() - t0, 2), "ok": False, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:]}
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return None
        finally:
            self.save()


def _model(work: Path, tiny: bool, tokenizer: str | None) -> str:
    from dist_nce.core.models import BERT_BASE, make_tiny_bert

    path = work / ("tiny_bert" if tiny else "bert_base_random")
    if not (path / "config.json").exists():
        make_tiny_bert(path, **({} if tiny else BERT_BASE), tokenizer_dir=tokenizer)
    return str(path)


def _bert_dict(model: str) -> dict[str, Any]:
    """The job's model as the config dict benchmarks.gpu_train builds its towers from (same shapes, dropout)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, local_files_only=True).to_dict()


def _overrides(work: Path, model: str, tiny: bool, extra: list[str]) -> list[str]:
    return [*(TINY_SETS if tiny else []),
            f"model.retriever.mention_model={model}",
            f"data.prepared_dir={work / 'data' / 'prepared'}", f"data.synthetic_dir={work / 'data' / 'synthetic'}",
            f"run.output_dir={work / 'run'}", f"run.storage_path={work / 'ray_results'}",
            f"run.name=gpu_e2e_{time.strftime('%Y%m%d-%H%M%S')}",
            "service.keep_versions=8",  # every refresh's manifest stays, for its encode seconds
            *extra]


def _submit(head, entrypoint: list[str], log_path: Path, name: str) -> dict[str, Any]:
    from dist_nce.cluster.submit import submit_and_follow

    t0 = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        rc = submit_and_follow(head.bin_dir, head.address, entrypoint, head.env, cwd=ROOT,
                               job_id=f"gpu_e2e_{name}_{int(time.time())}", log=log)
    said = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log_path)}
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the {name} job failed (ray job status not SUCCEEDED); log tail:\n{tail}")
    return said


def _kb_lengths(store_dir: Path) -> tuple[list[tuple[int, int]], str]:
    """(token length, rows) of the prepared KB: from the store, or where only its manifest is at hand
    (a run assembled from a GPU lease's files) every row at the manifest's mean length (the attention
    term, ~2% of the FLOPs at 128 tokens, is then slightly under-counted)."""
    import numpy as np

    if any(store_dir.glob("part-*.arrow")):
        from kb.store import EntityStore

        store = EntityStore(str(store_dir))
        lengths = np.asarray(store.lengths(np.arange(len(store))))
        values, counts = np.unique(lengths, return_counts=True)
        return [(int(v), int(c)) for v, c in zip(values, counts)], "the store's token lengths"
    stats = json.loads((store_dir / "manifest.json").read_text())["entities"]
    return [(float(stats["token_stats"]["mean"]), int(stats["count"]))], "the store manifest's mean token length"


def train_figures(run_dir: Path, store_dir: Path, bert: dict[str, Any], shape: dict[str, int],
                  peak_tflops: float | None) -> dict[str, Any]:
    """From a finished run's files (``metrics.jsonl``, ``summary.json``, the shards' version manifests
    under ``run_dir/shards``) and the store's lengths: steps, refreshes and their MFU, the step's MFU.
    ``bert``: the towers' config dict; ``shape``: mentions, candidates, mention_len, cand_len."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out: dict[str, Any] = {"steps": step_records(lines)}
    refreshes = refresh_records(run_dir / "shards")
    d, layers, inter = bert["hidden_size"], bert["num_hidden_layers"], bert["intermediate_size"]
    matmul = layers * (4 * d * d + 2 * d * inter)  # Q, K, V, O + the two MLP matrices
    lengths, source = _kb_lengths(store_dir)
    rows = sum(c for _, c in lengths)
    kb_flops = sum(c * encoder_flops(matmul, layers, d, [v]) for v, c in lengths)
    for r in refreshes:
        if r["seconds"]:
            r["tflops_per_s"] = kb_flops * r["rows"] / rows / r["seconds"] / 1e12
            r["mfu"] = r["tflops_per_s"] / peak_tflops if peak_tflops else None
    out["refreshes"] = refreshes
    out["kb"] = {"entities": rows, "tokens_mean": sum(v * c for v, c in lengths) / rows,
                 "encode_tflop": kb_flops / 1e12, "lengths_from": source,
                 "mfu_counts": "useful tokens only (no padding), forward: 2 x matmul params x T + 4 L T^2 d"}
    # the step's model FLOPs at the config's shapes (every candidate at entity_max_len: the synthetic
    # texts fill 128 tokens in the longest row of nearly every 512-candidate batch, so little is trimmed)
    b, k, lm, lc = shape["mentions"], shape["candidates"], shape["mention_len"], shape["cand_len"]
    step_flops = 3 * (encoder_flops(matmul, layers, d, [lm] * b) + encoder_flops(matmul, layers, d, [lc] * (b * k)))
    out["step_flops"] = step_flops
    for key, part in (("e2e", "step_s"), ("e2e_no_refresh", "step_s_no_refresh")):
        med = (out["steps"].get(part) or {}).get("median")
        out[f"{key}_tflops_per_s"] = step_flops / med / 1e12 if med else None
        out[f"{key}_mfu"] = step_flops / med / 1e12 / peak_tflops if med and peak_tflops else None
    summary = json.loads((run_dir / "summary.json").read_text())
    out["job"] = {k: summary.get(k) for k in ("done", "step", "seconds", "dev_before", "dev_after", "export",
                                              "kb_snapshot", "engine", "index_version", "deepspeed_config")}
    return out


def _shape(cfg) -> dict[str, int]:
    return {"mentions": cfg.optim.batch_size, "candidates": cfg.negatives.num_candidates,
            "mention_len": cfg.data.mention_max_len, "cand_len": cfg.data.entity_max_len}


def _mining_in_subprocess(head, args: argparse.Namespace, work: Path, repeats: int) -> dict[str, Any]:
    """:func:`_mining` in a driver process of its own on the head (as the job's driver is: Ray reads the
    cluster's address and token from the environment it is imported in)."""
    from dist_nce.cluster.runtime import ray_env

    out = work / "mining.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_e2e", "--config", args.config, "--work", str(work),
           "--mining-stage", str(out), "--mining-repeats", str(repeats), *(["--tiny"] if args.tiny else []),
           *[x for o in args.set for x in ("--set", o)]]
    env = {**os.environ, **ray_env(), **head.env, "RAY_ADDRESS": head.gcs_address}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the mining driver failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _mining(cfg, work: Path, repeats: int) -> dict[str, Any]:
    """One mining call through the service against the kernel alone, on the job's final encoding."""
    import ray
    import torch

    from benchmarks.common import compare, interleaved
    from benchmarks.gpu_common import synced
    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import init_ray
    from dist_nce.index.search import ShardIndex
    from dist_nce.modeling.scoring import Reps
    from dist_nce.modeling.retriever import Retriever
    from dist_nce.sampling.negatives import num_hard

    init_ray(log_to_driver=False)  # RAY_ADDRESS: the head's
    try:
        run_dir = work / "run"
        retriever = Retriever.from_pretrained(run_dir / "model")
        service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, str(run_dir))
        try:
            t0 = time.perf_counter()
            # the version the job persisted with the final weights: reloaded, not encoded again
            final = json.loads((run_dir / "summary.json").read_text()).get("index_version") or 0
            version = service.ensure_encoded(retriever.entity_encoder_state(), version=int(final))
            loaded_s = time.perf_counter() - t0
            k1 = cfg.negatives.num_candidates - 1
            hard = num_hard(cfg.negatives.p, k1)
            snap = json.loads((run_dir / "kb_snapshot" / "manifest.json").read_text())
            import numpy as np

            emb = np.load(run_dir / "kb_snapshot" / snap.get("embeddings", "embeddings.npy"), mmap_mode="r")
            device = cfg.service.index.device if cfg.service.index.device != "auto" else (
                "cuda" if torch.cuda.is_available() else "cpu")
            ents = torch.from_numpy(np.ascontiguousarray(emb)).to(device)
            idx = ShardIndex(retriever.spec, Reps(ents), 0, cfg.service.index)
            rows = []
            for batch in sorted({cfg.optim.batch_size, 128}):
                g = torch.Generator().manual_seed(batch)
                q = torch.randn(batch, ents.shape[1], generator=g) * ents[:1024].float().std().item()
                gold = torch.randint(0, ents.shape[0], (batch,), generator=g)
                keys = torch.arange(batch)
                qd = q.to(device)
                methods = {
                    "service.mine (Ray call, shards, merge)":
                        lambda: service.mine(q, gold, hard, k1 - hard, 7, keys).result(),
                    "kernel alone (hard part, one index)":
                        lambda: idx.gumbel_topk(qd, hard, gold, 7, keys),
                }
                runs = interleaved({n: synced(f, device) for n, f in methods.items()}, repeats, 2)
                row = {"batch": batch, "hard": hard, "random": k1 - hard, **runs}
                row["service_vs_kernel"] = compare(runs["service.mine (Ray call, shards, merge)"],
                                                   runs["kernel alone (hard part, one index)"])
                rows.append(row)
            return {"version": version, "ensure_encoded_s": round(loaded_s, 2), "rows": rows,
                    "entities": int(ents.shape[0]), "dim": int(ents.shape[1]), "dtype": str(ents.dtype)}
        finally:
            service.shutdown()
    finally:
        ray.shutdown()


def _kilt_eval(head, cfg, work: Path, log_path: Path) -> dict[str, Any]:
    run_dir = work / "run"
    out = work / "kilt_eval"
    svc = cfg.service
    entry = ["python", "jobs/evaluate_kilt_aida.py", "--model", str(run_dir / "model"),
             "--store", cfg.data.prepared_dir, "--out", str(out), "--snapshot-dir", str(run_dir / "shards"),
             "--set", f"num_shards={svc.num_shards}", "--set", f"num_gpus={svc.num_gpus}",
             "--set", f"num_cpus={svc.num_cpus}", "--set", f"encode_batch_size={svc.encode_batch_size}",
             "--set", f"index.backend={svc.index.backend}", "--set", f"index.score_dtype={svc.index.score_dtype}"]
    said = _submit(head, entry, log_path, "kilt_eval")
    said["scores"] = json.loads((out / "scores.json").read_text())
    return said


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides of the config")
    ap.add_argument("--tiny", action="store_true", help="the CPU rehearsal: the config at tiny size")
    ap.add_argument("--work", default=None, help="data, run and logs (default: runs/gpu_e2e[_tiny] here)")
    ap.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/gpu_e2e.json; --tiny: <work>)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer files for the random BERT (default: MiniLM's)")
    ap.add_argument("--engine-steps", type=int, default=None, help="timed bare engine steps (default 12; tiny 2)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="what to run (default all): a GPU call too short for all runs the train job, a second "
                         "one on the same warm machine and work dir the rest")
    ap.add_argument("--force", action="store_true", help="record even above the load limit (marked noisy)")
    ap.add_argument("--keep-ray-logs", action="store_true", help="keep the head's session logs in /tmp/rh_*")
    ap.add_argument("--assemble", default=None, metavar="DIR",
                    help="no run: the JSON from a GPU run's files in DIR and its calls' partial JSONs (--partial)")
    ap.add_argument("--partial", action="append", default=[], help="with --assemble: a call's own gpu_e2e.json")
    ap.add_argument("--note", action="append", default=[], help="with --assemble: a line for the JSON's notes")
    ap.add_argument("--load-note", default=None,
                    help="with --assemble, for calls that recorded no load guard: why the run was idle")
    ap.add_argument("--mining-stage", default=None, help=argparse.SUPPRESS)  # the mining driver: its JSON
    ap.add_argument("--mining-repeats", type=int, default=10, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import torch

    from dist_nce.core.config import load_config
    from dist_nce.train.config import TrainJobConfig

    work = Path(args.work or ROOT / "runs" / ("gpu_e2e_tiny" if args.tiny else "gpu_e2e")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (work / "gpu_e2e.json" if args.tiny else None)
    if args.mining_stage:
        from dist_nce.core.artifacts import atomic_write_json

        cfg = load_config(TrainJobConfig, ROOT / args.config, _overrides(work, _model(work, args.tiny, None),
                                                                        args.tiny, args.set))
        atomic_write_json(Path(args.mining_stage), _mining(cfg, work, args.mining_repeats))
        return 0
    if args.assemble:
        return assemble(Path(args.assemble), [Path(x) for x in args.partial], out or Path(args.assemble) / "gpu_e2e.json",
                        args.config, args.set, args.note,
                        {"noisy": False, "load_guard": args.load_note} if args.load_note else None)
    from benchmarks.common import LOAD_LIMIT, load_guard

    guard = load_guard(args.force or args.tiny, max(LOAD_LIMIT, 0.75 * (os.cpu_count() or 2)))
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda and not args.tiny else "cpu"
    payload: dict[str, Any] = {"benchmark": "gpu_e2e (issue 35)", "config": args.config, "tiny": args.tiny,
                               "targets": TARGETS, "started": time.strftime("%Y-%m-%d %H:%M:%S"), **guard}
    from benchmarks.gpu_common import bf16_peak, device_header

    payload.update(device_header(device))
    run = Run(out or ROOT / "benchmarks" / "results" / "gpu_e2e.json", payload)
    peak = run.stage("peak", lambda: bf16_peak(None, device, 8192 if device == "cuda" else 256,
                                               20 if device == "cuda" else 3))
    if peak:
        payload["peak_tflops"], payload["peak_source"] = peak
    model = run.stage("model", lambda: _model(work, args.tiny, args.tokenizer))
    if model is None:
        return 1
    overrides = _overrides(work, model, args.tiny, args.set)
    payload["overrides"] = overrides
    cfg = load_config(TrainJobConfig, ROOT / args.config, overrides)
    # The bare engine first, on the GPU alone (and so that a run cut short still has the baseline).
    from benchmarks import gpu_train

    steps = args.engine_steps or (2 if args.tiny else 12)
    env_before = dict(os.environ)  # the engine's single-process RANK, MASTER_PORT, ... stay out of the head's env
    stages = set(args.stages.split(","))
    if stages - set(STAGES):
        ap.error(f"--stages: unknown {sorted(stages - set(STAGES))}; known: {','.join(STAGES)}")
    payload["stages_asked"] = sorted(stages)
    if "bare_engine" in stages:
        run.stage("bare_engine", lambda: _bare_engine(gpu_train.run(
            device, quick=args.tiny, peak_tflops=payload.get("peak_tflops"), steps=steps,
            warmup=2 if args.tiny else 3, configs={"engine": str(ROOT / cfg.deepspeed.config)}, profile=False,
            bert=None if args.tiny else _bert_dict(model))), key="bare_engine")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env_before)
    if cuda:
        torch.cuda.empty_cache()  # the GPU is the job's now
    from dist_nce.cluster.head import LocalHead

    memory = GpuMemory()
    if cuda:
        memory.start()
    log_path = work / "jobs.log"
    head = LocalHead(num_cpus=os.cpu_count() or 2, env={"TOKENIZERS_PARALLELISM": "false"},
                     keep_logs=args.keep_ray_logs, timeout_s=300)
    try:
        run.stage("head", head.start)
        entry = ["python", "jobs/aida_finetune.py", "--config", args.config]
        for o in overrides:
            entry += ["--set", o]
        if "train" in stages:
            run.stage("train_job", lambda: _submit(head, entry, log_path, "train"), key="train_job")
            payload["memory"] = memory.result() if cuda else {"available": False}
        # without "train": the run a previous call of the same work dir left (a warm GPU machine keeps it)
        run.stage("train_figures", lambda: train_figures(
            work / "run", Path(cfg.data.prepared_dir), _bert_dict(model), _shape(cfg), payload.get("peak_tflops")),
            key="train")
        _targets(payload)
        if "mining" in stages:
            run.stage("mining", lambda: _mining_in_subprocess(head, args, work, 3 if args.tiny else 10),
                      key="mining")
        if "kilt_eval" in stages:
            run.stage("kilt_eval", lambda: _kilt_eval(head, cfg, work, log_path), key="kilt_eval")
    finally:
        head.stop()
    _targets(payload)
    run.save()
    print(json.dumps(payload.get("checks", {}), indent=1))
    failed = [n for n, s in payload.get("stages", {}).items() if not s["ok"]]
    return 1 if failed else 0


def _bare_engine(engine: dict[str, Any]) -> dict[str, Any]:
    out = {k: engine.get(k) for k in ("batch", "model", "flops", "peak_tflops", "versions")}
    out["modes"] = {n: {k: v for k, v in m.items() if k != "traceback"} for n, m in engine["modes"].items()}
    return out


def _rel(path: Path) -> str:
    """``path`` relative to the checkout when inside it (a committed result names its sources portably)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def assemble(source: Path, partials: list[Path], out: Path, config: str, sets: list[str],
             notes: list[str] | None = None, load: dict[str, Any] | None = None) -> int:
    """The result of a GPU run whose stages ran in more than one call of a lease (each call's own JSON in
    ``partials``, earliest first; the run's files under ``source`` as in a work dir: ``run/metrics.jsonl``,
    ``run/summary.json``, ``run/shards/*/v*/manifest.json``, ``data/prepared/manifest.json``, and the
    towers' ``model_config.json``). Every figure is recomputed from those files by the functions above;
    ``provenance`` says which call gave what, ``missing`` which stages none finished."""
    from dist_nce.core.config import load_config
    from dist_nce.train.config import TrainJobConfig

    payload: dict[str, Any] = {"benchmark": "gpu_e2e (issue 35)", "config": config, "tiny": False,
                               "targets": TARGETS, "assembled_from": [_rel(p) for p in partials], "provenance": {},
                               "notes": list(notes or []), **(load or {})}
    for path in partials:
        part = json.loads(path.read_text())
        for key in ("load_average_before", "load_limit", "noisy", "device_name", "versions", "peak_tflops", "peak_source", "overrides", "bare_engine", "memory",
                    "train_job", "mining", "kilt_eval", "train"):
            if part.get(key) is not None and key not in payload:
                payload[key] = part[key]
                payload["provenance"][key] = path.name
    if (source / "run" / "metrics.jsonl").exists():  # else the train figures of the call that had the files
        cfg = load_config(TrainJobConfig, ROOT / config, sets)
        bert = json.loads((source / "model_config.json").read_text())
        payload["train"] = train_figures(source / "run", source / "data" / "prepared", bert, _shape(cfg),
                                         payload.get("peak_tflops"))
        payload["provenance"]["train"] = f"recomputed from the run's files ({_rel(source)})"
    payload["missing"] = [k for k in ("bare_engine", "memory", "train", "mining", "kilt_eval") if k not in payload]
    _targets(payload)
    from benchmarks.common import save_results

    save_results("gpu_e2e", payload, out)
    print(json.dumps(payload["checks"], indent=1))
    return 0


def _targets(payload: dict[str, Any]) -> None:
    """The issue's two targets, recomputed from the times above."""
    steps = ((payload.get("train") or {}).get("steps") or {})
    job_med = (steps.get("step_s") or {}).get("median")
    eng = (((payload.get("bare_engine") or {}).get("modes") or {}).get("engine") or {}).get("step_seconds") or {}
    checks: dict[str, Any] = {}
    if job_med and eng.get("median"):
        ratio = job_med / eng["median"]
        quiet = (steps.get("step_s_no_refresh") or {}).get("median")
        checks["step_ratio_to_engine"] = {"job_median_s": job_med, "engine_median_s": eng["median"],
                                          "ratio": ratio, "target": TARGETS["step_ratio_to_engine"],
                                          "met": ratio <= TARGETS["step_ratio_to_engine"],
                                          "ratio_without_refresh_in_flight": quiet / eng["median"] if quiet else None}
    frac = steps.get("negatives_wait_fraction_refresh_in_flight")
    if frac is None:
        frac = steps.get("negatives_wait_fraction")
    if frac is not None:
        checks["negatives_wait_fraction"] = {"fraction": frac, "target": TARGETS["negatives_wait_fraction"],
                                             "with_refresh_in_flight": steps.get(
                                                 "negatives_wait_fraction_refresh_in_flight") is not None,
                                             "met": frac < TARGETS["negatives_wait_fraction"]}
    payload["checks"] = checks


if __name__ == "__main__":
    sys.exit(main())
