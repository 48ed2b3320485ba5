"""``run.tracking``: the config section, the pure helpers, and a tracked tiny run read back.

The run is the reranker's worker on the local engine (one process, the scaffold every trainer
shares: resume -> RunLogger -> tracker), with MLflow on a real file store and W&B in offline
mode, both through Ray's integrations. Read back with MlflowClient and W&B's own records, each
must hold what metrics.jsonl holds, at the same steps, and the run's config as params; a second
run in the same output directory continues the same MLflow and W&B runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_nce.core.config import ConfigError, load_config, to_dict
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.train.config import TrainJobConfig
from dist_nce.worker.tb import read_metrics
from dist_nce.worker.tracking import (RECORD, flatten, mlflow_key, param_text, params_of, read_record,
                                      summary_scores)
from tests.rerank.test_rerank_data import config, setup  # noqa: F401  (setup: a fixture)
from tests.tracking_helpers import mlflow_history, wandb_runs

REPO = Path(__file__).resolve().parents[2]
TRAIN_CONFIG = REPO / "configs" / "aida" / "test_tiny.yaml"
RERANK_CONFIG = REPO / "configs" / "zeshel" / "reranker_test_tiny.yaml"


@pytest.mark.parametrize("cls, path", [(TrainJobConfig, TRAIN_CONFIG), (RerankJobConfig, RERANK_CONFIG)])
def test_both_trainers_have_tracking_off_by_default(cls, path):
    cfg = load_config(cls, path)
    assert not cfg.run.tracking.enabled and not cfg.run.tracking.mlflow.enabled and not cfg.run.tracking.wandb.enabled
    on = load_config(cls, path, ["run.tracking.mlflow.enabled=true", "run.tracking.mlflow.tracking_uri=file:///x/m",
                                 "run.tracking.wandb.enabled=true", "run.tracking.wandb.mode=offline"])
    assert on.run.tracking.enabled and on.run.tracking.wandb.mode == "offline"


@pytest.mark.parametrize("yaml_text, message", [
    ("run: {tracking: {mlflow: {experimnt: x}}}",
     "run.tracking.mlflow.experimnt: unknown key for MlflowConfig; expected one of"),
    ("run: {tracking: {neptune: {enabled: true}}}", "run.tracking.neptune: unknown key for TrackingConfig"),
    ("run: {tracking: {wandb: {mode: online-ish}}}", "run.tracking.wandb.mode: 'online-ish' is not one of"),
    ("run: {tracking: {mlflow: {enabled: true}}}", "run.tracking.mlflow: tracking_uri: required when enabled"),
    ("run: {tracking: {mlflow: {tracking_uri: mlruns}}}",
     "run.tracking.mlflow.tracking_uri: 'mlruns': must be a URI"),
])
def test_bad_tracking_settings_are_refused_naming_file_and_key(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(RerankJobConfig, path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value), str(e.value)


def test_params_metric_names_and_summary_scores():
    cfg = load_config(TrainJobConfig, TRAIN_CONFIG, ["run.tracking.wandb.enabled=true"])
    params = params_of(to_dict(cfg))
    assert params["optim.lr"] == 3e-3 and params["run.eval_k"] == [1, 4, 16]
    assert params["model.retriever.preset"] == "dual"
    assert not [k for k in params if k.startswith("run.tracking.")]  # where it goes is not what was trained
    assert params["run.resources_per_worker"] == {}  # an empty section is a value, not nothing
    assert [param_text(params[k]) for k in ("run.eval_k", "run.progress", "optim.lr", "run.name")] == \
        ["[1, 4, 16]", "false", "0.003", "test_tiny"]
    assert flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}
    assert mlflow_key("dev/recall@64") == "dev/recall_at_64" and mlflow_key("train/loss") == "train/loss"
    assert mlflow_key("bias/norm[0]") == "bias/norm_0_"
    summary = {"config": {"optim": {"lr": 1.0}}, "deepspeed_config": {"train_batch_size": 4}, "done": True,
               "step": 24, "dev_after": {"recall@16": 0.5, "n_mentions": 32}, "export": {"model": "/m", "blink": None},
               "eval": {"val": {"macro": {"unnormalized_accuracy": 0.25}}}, "kb_updates": [1, 2],
               "plan": {"total_steps": 24, "settings": {"optim.lr": 1.0}}}  # settings: config values again
    assert summary_scores(summary) == {"summary/done": 1.0, "summary/step": 24.0, "summary/dev_after/recall@16": 0.5,
                                       "summary/plan/total_steps": 24.0,
                                       "summary/dev_after/n_mentions": 32.0,
                                       "summary/eval/val/macro/unnormalized_accuracy": 0.25}


# The worker's and the driver's tracking calls with tracking off, in a fresh interpreter (the jobs'
# modules imported too), then what that interpreter imported. tests/jobs/test_tracking_jobs.py runs a
# whole job this way.
OFF = """
import json, sys
import dist_nce.cli.aida_finetune, dist_nce.cli.zeshel_reranker, dist_nce.cli.zeshel_retriever, dist_nce.worker.scaffold
from dist_nce.core.config import load_config, to_dict
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.worker.tb import RunLogger
from dist_nce.worker.tracking import finish_tracking, missing_packages, start_tracking
cfg = load_config(RerankJobConfig, sys.argv[1], ["run.output_dir=" + sys.argv[2]])
assert not missing_packages(cfg.run.tracking)
tracker = start_tracking(cfg.run.tracking, to_dict(cfg), cfg.run.output_dir, cfg.run.name)
log = RunLogger(cfg.run.output_dir, 0, 2, 0, False, tracker)
log.log(0, {"train/loss": 1.0})
log.close()
finish_tracking(cfg.run.tracking, cfg.run.output_dir, cfg.run.name, {"step": 1, "done": True}, None)
print(json.dumps({"tracker": repr(tracker), "loaded": sorted(
    m for m in sys.modules if m.split(".")[0] in ("mlflow", "wandb") or m.startswith("ray.air.integrations"))}))
"""


def test_with_tracking_off_nothing_of_a_tracker_is_imported(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", OFF, str(RERANK_CONFIG), str(tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"tracker": "None", "loaded": []}
    assert (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / RECORD).exists()


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    """W&B's own files (cache, staging, settings) under tmp_path rather than the home directory."""
    for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Unset during the test and restored after it: the run sets the first (dist_nce.worker.tracking)
    # and Ray's setup_wandb the second in this process. (setenv first, so that monkeypatch records
    # the value to restore even when there was none.)
    for var in ("MLFLOW_ALLOW_FILE_STORE", "WANDB_START_METHOD", "MLFLOW_RUN_ID"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return tmp_path


def _tracked_config(root: Path, model_dir: str, out: Path, store: Path) -> RerankJobConfig:
    cfg = config(root)
    cfg.model.reranker.model, cfg.model.reranker.head, cfg.model.reranker.max_len = model_dir, "cls", 48
    cfg.deepspeed.config = str(REPO / "configs" / "deepspeed" / "zero0_fp32.json")
    cfg.optim.epochs, cfg.run.output_dir, cfg.run.progress, cfg.run.eval_batch_size = 1, str(out), False, 4
    cfg.run.name = "tracked_tiny"
    t = cfg.run.tracking
    t.mlflow.enabled, t.mlflow.tracking_uri, t.mlflow.experiment = True, store.as_uri(), "tiny"
    t.mlflow.tags = {"k": "v"}
    t.wandb.enabled, t.wandb.mode, t.wandb.project = True, "offline", "tiny"
    return cfg


def test_a_tracked_run_reads_back_as_its_metrics_jsonl(setup, tiny_model_dir, tracker_env):  # noqa: F811
    from mlflow.tracking import MlflowClient

    from dist_nce.rerank.loop import LocalRerankWorker

    out, store = tracker_env / "run", tracker_env / "mlruns"
    cfg = _tracked_config(setup, tiny_model_dir, out, store)
    result = LocalRerankWorker(cfg, 0, 1, "cpu").run()
    assert result["done"]
    jsonl = read_metrics(out / "metrics.jsonl")
    assert len(jsonl) == result["plan"]["total_steps"] >= 3 and all("train/loss" in v for v in jsonl.values())

    record = read_record(out)
    client = MlflowClient(tracking_uri=store.as_uri())
    run = client.get_run(record["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked_tiny" and run.data.tags["k"] == "v"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    assert mlflow_history(client, run.info.run_id) == {
        s: {mlflow_key(k): v for k, v in vals.items()} for s, vals in jsonl.items()}
    want = {k: param_text(v) for k, v in params_of(to_dict(cfg)).items()}
    assert run.data.params == want and "optim.lr" in want

    # W&B's dir defaults to run.output_dir. Whole at once: the worker waited for W&B to write it (Ray
    # Train ends a worker with ray.kill, and no later W&B teardown would come).
    (wb,) = wandb_runs(out, wait_s=0)
    assert wb["id"] == record["wandb"]["id"] and record["wandb"]["project"] == "tiny"
    assert wb["history"] == jsonl
    assert {k: v for k, v in wb["config"].items() if not k.startswith("_")} == params_of(to_dict(cfg))

    # The same run directory again (a resumed job): the same MLflow run and W&B id, no second run.
    LocalRerankWorker(cfg, 0, 1, "cpu").run()
    assert read_record(out) == record
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == sorted(2 * list(jsonl))  # every step logged twice: both kept
    again = wandb_runs(out)
    assert len(again) == 2 and again[1]["id"] == wb["id"]
    assert json.loads((out / RECORD).read_text()) == record
