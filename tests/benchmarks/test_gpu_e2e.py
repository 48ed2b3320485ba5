"""benchmarks/gpu_e2e.py: its figures from a run's files (pure), and the whole thing at tiny size on a CPU:
the one-GPU config (configs/aida/one_gpu_dual_p50.yaml) submitted to a LocalHead with `ray job submit`,
the KILT evaluation job, the service-vs-kernel mining and the bare engine step, into one JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_e2e

REPO = Path(__file__).resolve().parents[2]


def _line(step, seconds, wait, version, published, compute=None):
    return {"step": step, "time/step_s": seconds, "time/negatives_wait_s": wait, "index/version": version,
            "index/published": published, "time/compute_s": compute if compute is not None else seconds - wait}


def test_step_records_split_steps_by_refresh_in_flight_and_leave_out_warm_ones():
    lines = [_line(s, 9.0, 5.0, 0, 0) for s in range(3)]  # warm-up: left out
    lines += [_line(s, 0.2, 0.0, 0, 0) for s in range(3, 7)]
    lines += [_line(s, 0.3, 0.01, 0, 1) for s in range(7, 10)]  # version 1 published, shards still encoding
    lines += [_line(s, 0.2, 0.0, 1, 1) for s in range(10, 12)]
    rec = gpu_e2e.step_records(lines, warm=3)
    assert rec["steps"] == 9
    assert rec["step_s_refresh_in_flight"]["n"] == 3 and rec["step_s_refresh_in_flight"]["median"] == pytest.approx(0.3)
    assert rec["step_s_no_refresh"]["n"] == 6 and rec["step_s_no_refresh"]["max"] == pytest.approx(0.2)
    assert rec["negatives_wait_fraction"] == pytest.approx(0.03 / (6 * 0.2 + 3 * 0.3))
    assert rec["negatives_wait_fraction_refresh_in_flight"] == pytest.approx(0.03 / 0.9)
    assert rec["versions_seen"] == [0, 1]
    assert gpu_e2e.step_records(lines[:3], warm=3) == {"steps": 0}


def test_step_parts_share_the_step_time_and_name_the_rest():
    def line(step, encode=None, device=None):
        r = {"step": step, "time/step_s": 0.30, "time/refresh_s": 0.01, "time/negatives_wait_s": 0.02,
             "time/batch_s": 0.03, "time/compute_s": 0.20, "time/mine_submit_s": 0.03}
        r = r if encode is None else {**r, "time/mine_encode_s": encode}
        return r if device is None else {**r, "time/compute_device_s": device}

    parts = gpu_e2e.step_records([line(s, encode=0.01, device=0.21 + s / 100) for s in range(4)], warm=0)["parts"]
    assert parts["steps"] == 4
    assert parts["compute"]["share"] == pytest.approx(0.2 / 0.3) and parts["compute"]["median_s"] == pytest.approx(0.2)
    assert parts["rest"]["median_s"] == pytest.approx(0.01) and parts["rest"]["share"] == pytest.approx(0.01 / 0.3)
    assert sum(v["share"] for k, v in parts.items() if k in (*gpu_e2e.STEP_PARTS, "rest")) == pytest.approx(1.0)
    assert parts["mine_encode"]["median_s"] == pytest.approx(0.01)  # inside mine_submit, beside the parts
    # the GPU's wall time for compute (past its host clock), beside the parts too; not every step has it: none
    assert parts["compute_device"] == {"share": pytest.approx(0.9 / 1.2), "median_s": pytest.approx(0.225)}
    assert gpu_e2e.step_parts([line(0, device=0.2), line(1)])["compute_device"] is None
    # a run logged before the encode had its own time: the parts without it; one without every part: none
    assert gpu_e2e.step_parts([line(s) for s in range(4)])["mine_encode"] is None
    assert gpu_e2e.step_parts([{"step": 0, "time/step_s": 0.3, "time/compute_s": 0.2}]) is None


def test_encoder_flops_is_the_matmul_and_attention_count():
    # one layer, hidden 4, 10 matmul parameters: 2 * 10 * T + 4 * 1 * T^2 * 4 per sequence
    assert gpu_e2e.encoder_flops(10, 1, 4, [3, 5]) == (2 * 10 * 3 + 16 * 9) + (2 * 10 * 5 + 16 * 25)


def test_refresh_records_read_each_versions_manifests(tmp_path):
    for shard, rows, secs in ((0, 600, 2.0), (1, 400, 3.0)):
        for version in (0, 1):
            d = tmp_path / f"shard-{shard:03d}-of-002" / f"v{version:08d}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_text(json.dumps({"shape": [rows, 8], "encode_seconds": secs * (version + 1),
                                                         "device": "cuda:0"}))
    recs = gpu_e2e.refresh_records(tmp_path)
    assert [r["version"] for r in recs] == [0, 1]
    assert recs[0]["rows"] == 1000 and recs[0]["seconds"] == 3.0  # the shards encode side by side
    assert recs[1]["entities_per_s"] == pytest.approx(1000 / 6.0)


def test_targets_are_recomputed_from_the_times():
    payload = {"train": {"steps": {"step_s": {"median": 0.23}, "negatives_wait_fraction": 0.001,
                                   "negatives_wait_fraction_refresh_in_flight": 0.03}},
               "bare_engine": {"modes": {"engine": {"step_seconds": {"median": 0.2}}}}}
    gpu_e2e._targets(payload)
    checks = payload["checks"]
    assert checks["step_ratio_to_engine"]["ratio"] == pytest.approx(1.15) and checks["step_ratio_to_engine"]["met"]
    assert checks["negatives_wait_fraction"]["fraction"] == 0.03 and not checks["negatives_wait_fraction"]["met"]


@pytest.mark.slow
@pytest.mark.ray
def test_the_one_gpu_config_end_to_end_at_tiny_size_on_a_cpu(tmp_path):
    """The benchmark as the GPU run does it, at tiny size: every stage runs and the JSON holds its figures."""
    out = tmp_path / "e2e.json"
    env = {**os.environ, "HOME": str(tmp_path / "home"), "RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": ""}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_e2e", "--tiny", "--work", str(tmp_path / "w"),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert out.exists(), said
    result = json.loads(out.read_text())
    failed = {n: s.get("error") for n, s in result["stages"].items() if not s["ok"]}
    assert done.returncode == 0 and not failed, (failed, said)
    job = result["train"]["job"]
    assert job["done"] and job["step"] == 16
    assert Path(job["export"]["blink"]).exists() and job["kb_snapshot"]["num_entities"] == 3000
    assert [r["version"] for r in result["train"]["refreshes"]] == [0, 1, 2]
    assert result["train"]["steps"]["steps"] == 6  # 16 steps, the first 10 left out
    assert result["kilt_eval"]["scores"]  # the KILT job scored dev over the whole KB
    assert result["mining"]["version"] == job["index_version"]  # the job's final encoding, reloaded
    row = result["mining"]["rows"][0]
    assert row["service_vs_kernel"]["x_median"] > 0
    assert set(result["checks"]) == {"step_ratio_to_engine", "negatives_wait_fraction"}
    # the job logged every part of its steps, the mention encode inside the mining submit included
    parts = result["train"]["steps"]["parts"]
    assert parts["steps"] == 6 and parts["compute"]["median_s"] > 0
    assert 0 < parts["mine_encode"]["median_s"] <= parts["mine_submit"]["median_s"], parts
    assert parts["compute_device"] is None  # a CPU has no device clock (dist_nce/worker/device_time.py)


def test_the_committed_result_is_what_its_committed_sources_assemble_to(tmp_path):
    """benchmarks/results/gpu_e2e.json was assembled from a GPU lease's files, committed beside it: every
    figure in it (and so on the pages) is recomputed from them here."""
    committed = json.loads((REPO / "benchmarks" / "results" / "gpu_e2e.json").read_text())
    sources = REPO / "benchmarks" / "results" / "gpu_e2e_h200"
    out = tmp_path / "again.json"
    gpu_e2e.assemble(sources, [REPO / p for p in committed["assembled_from"]], out, committed["config"],
                     ["deepspeed.config=configs/deepspeed/zero0_bf16.json"], committed["notes"],
                     {"noisy": committed["noisy"], "load_guard": committed["load_guard"]})
    again = json.loads(out.read_text())
    assert again["train"] == committed["train"] and again["checks"] == committed["checks"]
    assert again == committed
