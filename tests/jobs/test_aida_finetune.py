"""jobs/aida_finetune.py as users run it: config errors up front, and the whole pipeline
through ``ray job submit`` against a head started with ``ray start --head``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

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


def test_a_blink_checkpoint_of_another_architecture_fails_before_any_cluster_work(tmp_path, tiny_model_dir):
    """A BLINK biencoder (tiny: hidden 64) must match the architecture the shards are sized from: it passed
    --dry-run, then failed after Ray started (shards of MiniLM's 384 refusing its encodings, or a shape
    mismatch naming no key)."""
    from dist_nce.core.models import make_tiny_bert
    from tests.blink_helpers import write_blink_biencoder

    bi = write_blink_biencoder(tmp_path / "biencoder_wiki_large.bin")
    common = ["--config", "configs/aida/test_tiny.yaml", "--set", f"model.blink_checkpoint={bi}",
              "--set", f"data.prepared_dir={tmp_path / 'kb'}", "--set", "data.synthetic_entities=8", "--dry-run"]
    r = run_job(*common, "--set", "model.retriever.mention_model=null")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"model.blink_checkpoint: {bi} holds encoders of hidden size 64, but the shards are sized from the "
            "default model (MiniLM; model.retriever.mention_model is unset): 384") in r.stderr, r.stderr[-2000:]
    r = run_job(*common, "--set", f"model.retriever.mention_model={tiny_model_dir}")  # hidden 32
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"(the architecture is model.retriever.mention_model's: {tiny_model_dir}/config.json)" in r.stderr
    # the checkpoint's own architecture (tests/blink_helpers.tiny_bert's) passes
    same = make_tiny_bert(tmp_path / "bert64", hidden_size=64, num_layers=2, num_heads=1, intermediate_size=96)
    r = run_job(*common, "--set", f"model.retriever.mention_model={same}")
    assert r.returncode == 0 and "config and inputs OK" in r.stdout + r.stderr, r.stderr[-2000:]


def test_a_second_job_on_a_run_in_use_is_refused_before_any_cluster_work(tmp_path, tiny_model_dir):
    """Another live process holds the run (here this test, through the job's own lock): the job stops with
    status 2 and one line naming the run directory, its holder and what to do, before any data or Ray work;
    a --dry-run of the same config still checks it (a config checked while its run trains is no second run).
    The same run.name and storage with another run.output_dir is refused too: Ray Train's run is shared."""
    import socket
    from types import SimpleNamespace

    from dist_nce.cli.common import hold_run
    from dist_nce.core.run_lock import acquire

    out, storage = tmp_path / "out", tmp_path / "ray"
    job = ["--config", "configs/aida/test_tiny.yaml", "--set", f"model.retriever.mention_model={tiny_model_dir}",
           "--set", f"data.prepared_dir={tmp_path / 'kb'}", "--set", f"data.synthetic_dir={tmp_path / 'synth'}",
           "--set", f"run.storage_path={storage}", "--set", "run.name=locked"]
    with acquire(out):
        r = run_job(*job, "--set", f"run.output_dir={out}")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.startswith(f"error: run directory {out} is in use by another job (pid {os.getpid()} on host "
                                   f"{socket.gethostname()}, since "), r.stderr
        assert r.stderr.endswith(f"; lock {out / '.lock'}): wait for it to end, stop it, or use another run.name / "
                                 "run.output_dir\n"), r.stderr
        assert r.stdout == "" and not (tmp_path / "kb").exists() and not (tmp_path / "synth").exists()
        r = run_job(*job, "--set", f"run.output_dir={out}", "--dry-run")
        assert r.returncode == 0 and "config and inputs OK" in r.stdout, r.stderr[-2000:]
    held = hold_run(SimpleNamespace(output_dir=str(tmp_path / "first"), storage_path=str(storage), name="locked"))
    with held:
        r = run_job(*job, "--set", f"run.output_dir={out}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith(f"error: Ray Train run {storage / 'locked'} is in use by another job (pid "
                               f"{os.getpid()} "), r.stderr
    assert not (tmp_path / "kb").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_ray_job_submit_runs_the_whole_pipeline(ray_head, tiny_model_dir, tmp_path, monkeypatch):
    """The whole job through `ray job submit`, tracked to an MLflow file store and an offline W&B run
    (run.tracking; W&B's own files go to the head's empty HOME)."""
    out, store = tmp_path / "out", tmp_path / "mlruns"
    tracking = ["run.tracking.mlflow.enabled=true", f"run.tracking.mlflow.tracking_uri={store.as_uri()}",
                "run.tracking.mlflow.experiment=aida", "run.tracking.wandb.enabled=true",
                "run.tracking.wandb.mode=offline", "run.tracking.wandb.project=aida"]
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--working-dir", ".", "--",
           "python", JOB, "--config", "configs/aida/test_tiny.yaml",
           "--set", f"model.retriever.mention_model={tiny_model_dir}",
           "--set", f"data.prepared_dir={tmp_path / 'kb'}", "--set", f"data.synthetic_dir={tmp_path / 'synthetic'}",
           "--set", f"run.output_dir={out}", "--set", f"run.storage_path={tmp_path / 'ray_results'}",
           *(a for t in tracking for a in ("--set", t))]
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
    assert summary["engine"] == {"device": "cpu", "accelerator": "cpu", "zero_stage": 2, "bf16": False, "world_size": 2}
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
    from dist_nce.worker.tb import read_metrics

    steps = read_metrics(out / "metrics.jsonl")
    trained = [s for s in sorted(steps) if "train/loss" in steps[s]]
    assert trained == list(range(24))
    versions = [steps[s]["index/version"] for s in trained]
    assert versions == sorted(versions) and versions[-1] >= 3
    assert steps[23]["index/published"] == 5  # steps 4, 8, 12, 16, 20
    staleness = [steps[s]["index/staleness"] for s in trained]
    assert min(staleness) >= 0 and max(staleness) >= 3
    assert any((out / "tensorboard").iterdir())

    # Tracking: rank 0's scalars, each (metric, step) once as in metrics.jsonl, then the driver's summary
    # scores and the exported model, all in the one MLflow run and W&B id the run directory records.
    from mlflow.tracking import MlflowClient

    from dist_nce.worker.tracking import mlflow_key, read_record
    from tests.tracking_helpers import mlflow_artifacts, mlflow_history, wandb_runs

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store the job wrote
    record = read_record(out)
    client = MlflowClient(tracking_uri=store.as_uri())
    assert [r.info.run_id for r in client.search_runs([record["mlflow"]["experiment_id"]])] == \
        [record["mlflow"]["run_id"]]
    run = client.get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["optim.batch_size"] == "4"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(24))
    history = mlflow_history(client, run.info.run_id)
    for s, values in steps.items():
        assert {k: history[s][mlflow_key(k)] for k in values} == values
    assert history[24]["summary/dev_after/recall_at_16"] == summary["dev_after"]["recall@16"]
    assert history[24]["summary/done"] == 1.0
    assert "model/manifest.json" in mlflow_artifacts(client, run.info.run_id)
    opened = wandb_runs(out)  # the worker's and the driver's
    assert len(opened) == 2 and {r["id"] for r in opened} == {record["wandb"]["id"]}
    merged: dict[int, dict[str, float]] = {}
    for r in opened:
        for s, values in r["history"].items():
            merged.setdefault(s, {}).update(values)
    assert merged == steps
    assert opened[-1]["summary"]["summary/dev_after/recall@16"] == summary["dev_after"]["recall@16"]
    assert opened[-1]["artifacts"][0]["type"] == "model"
