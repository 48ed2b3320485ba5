"""jobs/aida_finetune.py as users run it: config errors up front, and the whole pipeline
through ``ray job submit`` against a head started with ``ray start --head``."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.runtime import forget_stopped_head, free_port

REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/aida_finetune.py"
VENV_BIN = Path(sys.executable).parent


def run_job(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, JOB, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_a_bad_key_fails_before_any_cluster_work(tmp_path):
    r = run_job("--config", "configs/aida/test_tiny.yaml", "--set", "optim.lrr=1e-3",
                "--set", f"run.output_dir={tmp_path / 'out'}")
    assert r.returncode == 2
    assert "optim.lrr: unknown key for OptimConfig" in r.stderr and "Traceback" not in r.stderr
    assert "Ray" not in r.stdout + r.stderr and not (tmp_path / "out").exists()


def test_missing_files_are_all_named_before_any_cluster_work(tmp_path):
    r = run_job("--config", "configs/aida/test_tiny.yaml", "--set", "deepspeed.config=configs/deepspeed/nope.json",
                "--set", f"model.blink_checkpoint={tmp_path / 'biencoder_wiki_large.bin'}",
                "--set", f"data.prepared_dir={tmp_path / 'kb'}", "--set", "data.synthetic_entities=0",
                "--set", f"model.retriever.mention_model={tmp_path / 'bert'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for key in ("deepspeed.config: file not found", "model.blink_checkpoint: file not found",
                "model.retriever.mention_model: directory not found", "data.prepared_dir:"):
        assert key in r.stderr, r.stderr
    assert "Ray" not in r.stdout + r.stderr
    r = run_job("--config", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and "none.yaml: config file not found" in r.stderr


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the test process dies (e.g. a timeout kills pytest), so an
    interrupted session leaves no Ray head behind; ``ray start --block`` then stops its processes."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="session")
def ray_head():
    """``ray start --head --block`` in its own process session, with token auth (the default).

    Torn down by signalling that session's process group: ``ray stop`` would stop every Ray
    on the machine, including clusters this test did not start.
    """
    root = Path(tempfile.mkdtemp(prefix="rh_", dir="/tmp"))  # short: Ray's socket paths have a length limit
    token = root / "token"
    token.write_text(uuid.uuid4().hex)
    # Every listening port explicitly free: the defaults (client server 10001, agent 52365, ...)
    # may belong to another Ray on the same machine.
    ports = {flag: free_port() for flag in (
        "--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
        "--node-manager-port", "--object-manager-port")}
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    log = open(root / "ray_start.log", "w")
    head = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", *[x for kv in ports.items() for x in (kv[0], str(kv[1]))],
         "--num-cpus", "2", "--disable-usage-stats", "--temp-dir", str(root / "ray"), "--block"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 180
        while True:
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited: {(root / 'ray_start.log').read_text()[-2000:]}")
            if "Ray runtime started" in (root / "ray_start.log").read_text():
                break
            if time.monotonic() > deadline:
                raise TimeoutError("ray start --head did not come up")
            time.sleep(1)
        yield {"address": f"http://127.0.0.1:{ports['--dashboard-port']}", "env": env}
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end:
                try:
                    os.killpg(head.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
        head.wait(timeout=10)
        forget_stopped_head(ports["--port"])
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_job_submit_runs_the_whole_pipeline(ray_head, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--working-dir", ".", "--",
           "python", JOB, "--config", "configs/aida/test_tiny.yaml",
           "--set", f"model.retriever.mention_model={tiny_model_dir}",
           "--set", f"data.prepared_dir={tmp_path / 'kb'}", "--set", f"data.synthetic_dir={tmp_path / 'synthetic'}",
           "--set", f"run.output_dir={out}", "--set", f"run.storage_path={tmp_path / 'ray_results'}"]
    for _ in range(20):  # the head's job agent comes up a little after the head itself
        r = subprocess.run(cmd, cwd=REPO, env=ray_head["env"], capture_output=True, text=True, timeout=900)
        if "No available agent to submit job" not in r.stderr:
            break
        time.sleep(3)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "succeeded" in r.stdout + r.stderr
    # the job's own printout: the plan before, the dev table after
    for line in ("global batch: 4 mentions = 2 workers x 2", "K = 8 = gold + 7 negatives (4 hard + 3 random",
                 "entities: 400 in 2 shards", "training mentions: 16 of 96", "index version: 0", "recall@16"):
        assert line in r.stdout, line

    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] and summary["step"] == 24
    for phase in ("dev_before", "dev_after"):
        assert summary[phase]["n_mentions"] == 32 and 0 <= summary[phase]["accuracy"] <= 1
    # exports: HF retriever, BLINK layout (weights only), KB embeddings of the final index
    from dist_nce.modeling.retriever import Retriever

    assert Retriever.from_pretrained(out / "model").config.preset == "dual"
    blink = torch.load(out / "biencoder_blink.bin", weights_only=True)
    assert any(k.startswith("cand_encoder.bert_model.") for k in blink)
    snap = json.loads((out / "kb_snapshot" / "manifest.json").read_text())
    assert snap["version"] == summary["index_version"] and np.load(out / "kb_snapshot" / "embeddings.npy").shape == (400, 32)
    # asynchronous refresh every 4 steps: newer indexes arrive while training, staleness is logged
    from dist_nce.train.tb import read_metrics

    steps = read_metrics(out / "metrics.jsonl")
    trained = [s for s in sorted(steps) if "train/loss" in steps[s]]
    assert trained == list(range(24))
    versions = [steps[s]["index/version"] for s in trained]
    assert versions == sorted(versions) and versions[-1] >= 3
    assert steps[23]["index/published"] == 5  # steps 4, 8, 12, 16, 20
    staleness = [steps[s]["index/staleness"] for s in trained]
    assert min(staleness) >= 0 and max(staleness) >= 3
    assert any((out / "tensorboard").iterdir())
