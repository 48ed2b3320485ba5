"""``run.tracking`` through the jobs as users run them (subprocesses): refused settings before any
work, nothing imported when off, and tracked runs read back from a real MLflow file store and real
W&B offline run directories.

* the reranker job on its local backend (tests/rerank/test_rerank_data.py's synthetic Zeshel and
  the random tiny BERT): the worker's metrics, then the driver's summary scores (U.Acc/N.Acc) and
  the exported reranker as the ``model`` artifact, in the one run the worker opened;
The AIDA job through Ray Train is tracked in tests/jobs/test_aida_finetune.py's `ray job submit` run;
a run that stops and is run again continues its MLflow run and W&B id (tests/worker/test_tracking.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_nce.worker.tb import read_metrics
from dist_nce.worker.tracking import mlflow_key, read_record
from tests.rerank.test_rerank_data import setup  # noqa: F401  (a fixture)
from tests.tracking_helpers import mlflow_artifacts, mlflow_history, wandb_runs

REPO = Path(__file__).resolve().parents[2]
RERANK_CONFIG = str(REPO / "configs" / "zeshel" / "reranker_test_tiny.yaml")


def run_job(job: str, config: str, sets: list[str], env: dict[str, str] | None = None, timeout: int = 600,
            python: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(python or []), str(REPO / "jobs" / job), "--config", config]
    cmd += [a for s in sets for a in ("--set", s)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B's cache, artifact staging and settings under tmp_path, not the home directory."""
    home = tmp_path / "wandb_home"
    return {"WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_SILENT": "true"}


def tracking_sets(store: Path, project: str) -> list[str]:
    return ["run.tracking.mlflow.enabled=true", f"run.tracking.mlflow.tracking_uri={store.as_uri()}",
            f"run.tracking.mlflow.experiment={project}", "run.tracking.wandb.enabled=true",
            "run.tracking.wandb.mode=offline", f"run.tracking.wandb.project={project}"]


def rerank_sets(root: Path, model_dir: str, out: Path) -> list[str]:
    return [f"data.train_store={root / 'train'}", f"data.eval_store={root / 'eval'}",
            f"data.candidates_dir={root / 'cands'}", "data.num_candidates=6", f"model.reranker.model={model_dir}",
            f"run.output_dir={out}", "run.backend=local", "run.use_gpu=false", "optim.epochs=1"]


def test_a_bad_tracking_key_fails_before_any_work(tmp_path):
    r = run_job("zeshel_reranker.py", RERANK_CONFIG,
                ["run.tracking.wandb.projekt=x", f"run.output_dir={tmp_path / 'o'}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "run.tracking.wandb.projekt: unknown key for WandbConfig; expected one of" in r.stderr
    assert not (tmp_path / "o").exists()


# The job's own start with a tracker's package made unimportable: the driver names the extra.
BLOCK_MLFLOW = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "mlflow":
            raise ImportError("mlflow is blocked in this test")
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_tracker_that_is_not_installed_is_named_before_any_work(tmp_path):
    r = run_job("zeshel_reranker.py", RERANK_CONFIG, [*tracking_sets(tmp_path / "mlruns", "p"),
                                                      f"model.reranker.model={tmp_path / 'no_model'}"],
                python=["-c", BLOCK_MLFLOW])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # listed with the job's other missing inputs
    assert "run.tracking.mlflow: enabled, but mlflow is not installed (pip install -e '.[mlflow]')" in r.stderr
    assert "model.reranker.model: directory not found" in r.stderr
    assert "run.tracking.wandb" not in r.stderr  # installed


# The job's main() in a fresh interpreter, then what that interpreter imported.
IMPORTS_AFTER = """
import json, sys
from dist_nce.cli.zeshel_reranker import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("mlflow", "wandb")
                                             or m.startswith("ray.air.integrations"))}))
"""


def test_with_tracking_off_no_tracker_is_imported(setup, tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = ["--config", RERANK_CONFIG, *(a for s in rerank_sets(setup, tiny_model_dir, out) for a in ("--set", s))]
    r = subprocess.run([sys.executable, "-c", IMPORTS_AFTER, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {"rc": 0, "loaded": []}
    assert json.loads((out / "summary.json").read_text())["done"] and not (out / "tracking.json").exists()


@pytest.mark.slow
def test_the_reranker_job_logs_its_scores_and_model_into_the_workers_run(setup, tiny_model_dir, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store the job wrote

    out, store = tmp_path / "run", tmp_path / "mlruns"
    r = run_job("zeshel_reranker.py", RERANK_CONFIG, [*rerank_sets(setup, tiny_model_dir, out),
                                                      *tracking_sets(store, "rerank")], env=wandb_env(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    record = read_record(out)
    assert f"tracking: MLflow run {record['mlflow']['run_id']}: " in r.stdout and ", model artifact" in r.stdout

    client = MlflowClient(tracking_uri=store.as_uri())
    run = client.get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "zeshel_reranker_test_tiny"
    history = mlflow_history(client, run.info.run_id)
    step = summary["step"]
    jsonl = read_metrics(out / "metrics.jsonl")
    for s, values in jsonl.items():
        assert {k: history[s][mlflow_key(k)] for k in values} == values  # the worker's metrics
    macro = summary["eval"]["val"]["unnormalized_accuracy"]["macro"]
    assert history[step]["summary/eval/val/unnormalized_accuracy/macro"] == pytest.approx(macro)
    assert history[step]["summary/eval/test/normalized_accuracy/micro"] == pytest.approx(
        summary["eval"]["test"]["normalized_accuracy"]["micro"])
    assert history[step]["summary/done"] == 1.0
    assert run.data.params["model.reranker.model"] == tiny_model_dir and run.data.params["data.num_candidates"] == "6"
    files = mlflow_artifacts(client, run.info.run_id)
    assert "model/manifest.json" in files
    assert sorted(f[len("model/"):] for f in files) == sorted(
        str(p.relative_to(out / "reranker")) for p in (out / "reranker").rglob("*") if p.is_file())

    worker, driver = wandb_runs(out)  # one offline directory per process that opened the run
    assert worker["id"] == driver["id"] == record["wandb"]["id"]
    assert worker["history"] == jsonl
    assert driver["summary"]["summary/eval/val/unnormalized_accuracy/macro"] == pytest.approx(macro)
    (artifact,) = driver["artifacts"]
    assert artifact["type"] == "model" and "manifest.json" in artifact["files"]
