"""MLflow and Weights & Biases for a training run, through Ray's integrations (``run.tracking``).

Off by default, and then nothing here imports MLflow, W&B or Ray's integrations. When on:

    worker    rank 0 opens the run with ``ray.air.integrations.mlflow.setup_mlflow`` /
              ``ray.air.integrations.wandb.setup_wandb`` (params: the run's config, flattened),
              :class:`~dist_nce.worker.tb.RunLogger` hands it every scalar it logs (same names,
              same steps), and the worker's last report closes it
    driver    once the job's summary.json is written, :func:`finish_tracking` reopens the same
              run: the summary's scores (``summary/...``), config keys the worker never saw
              (the Zeshel job's own section), the exported model directory as the ``model``
              artifact; MLflow's run is then marked FINISHED

One run directory is one tracked run: ``<run.output_dir>/tracking.json`` records the MLflow run
id and the W&B run id, so a resumed job, a restarted worker group and the driver's final step
all continue the run that is already there. W&B's id is chosen and recorded before the run
opens, so a crash right after it still resumes; MLflow assigns its id, recorded right after.

MLflow refuses ``@`` in names, so ``dev/recall@64`` is ``dev/recall_at_64`` there
(:func:`mlflow_key`); W&B keeps the names as they are. Re-trained steps after a restart are
logged again, as in metrics.jsonl: MLflow keeps both values (the later one counts), W&B drops
steps below the one its resumed run is at.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Callable

from dist_nce.cluster.runtime import environment
from dist_nce.core.artifacts import atomic_write_json
from dist_nce.worker.tracking_config import MlflowConfig, TrackingConfig, WandbConfig

RECORD = "tracking.json"
# Where the trackers go, not what was trained (and a tracking URI may carry credentials).
NOT_PARAMS = ("run.tracking.",)
# Summary sections that are configuration, logged as params rather than as scores (the plan's settings
# repeat config values: train.plan.RESUME_SETTINGS).
NOT_SCORES = ("config", "deepspeed_config", "plan/settings")


# ---------------------------------------------------------------------------- pure helpers

def flatten(tree: dict[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 2e-5}}`` -> ``{"optim.lr": 2e-5}``; lists and empty dicts are leaves."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def params_of(config: dict[str, Any]) -> dict[str, Any]:
    """A job config (``to_dict``) as tracker params: flattened, without ``run.tracking.*``."""
    return {k: v for k, v in flatten(config).items() if not k.startswith(NOT_PARAMS)}


def param_text(value: Any) -> str:
    """A param as MLflow stores it (text): strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def mlflow_key(name: str) -> str:
    """``dev/recall@64`` -> ``dev/recall_at_64``: MLflow takes only ``[/\\w.\\- :]`` in names."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


def summary_scores(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a job's summary.json (bools as 0/1) as ``summary/<dotted path with />``,
    without its config sections: the dev or Zeshel recall, the reranker's U.Acc/N.Acc, step..."""
    return {f"summary/{k}": float(v) for k, v in flatten(summary, sep="/").items()
            if not k.startswith(tuple(f"{s}/" for s in NOT_SCORES)) and k not in NOT_SCORES
            and isinstance(v, (int, float))}


# ---------------------------------------------------------------------------- the record

def read_record(output_dir: str | Path) -> dict[str, Any]:
    path = Path(output_dir) / RECORD
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _record(output_dir: str | Path, tracker: str, entry: dict[str, Any]) -> None:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(output_dir) / RECORD, {**read_record(output_dir), tracker: entry})


def _allow_file_store(uri: str) -> None:
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; a ``file:`` URI (or a
    path) in the config is the user's choice of one. Process-wide: every store access checks it."""
    if uri.startswith("file:") or "://" not in uri and not uri.startswith("databricks"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


# ---------------------------------------------------------------------------- MLflow

def _existing_mlflow_run(cfg: MlflowConfig, record: dict[str, Any]):
    """The recorded run when it is in this store and experiment and not deleted, else None."""
    if not record or record.get("tracking_uri") != cfg.tracking_uri or record.get("experiment") != cfg.experiment:
        return None
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri=cfg.tracking_uri).get_run(record["run_id"])
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _ensure_experiment(cfg: MlflowConfig) -> None:
    """Create the experiment unless it exists. The cells of a grid start at the same time, and
    setup_mlflow's look-then-create would fail in all but the first to create it."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    if client.get_experiment_by_name(cfg.experiment) is None:
        try:
            client.create_experiment(cfg.experiment)
        except MlflowException:
            if client.get_experiment_by_name(cfg.experiment) is None:  # not a lost race: a real failure
                raise


class MlflowRun:
    """Rank 0's MLflow run, opened by Ray's ``setup_mlflow`` (resumed when recorded)."""

    def __init__(self, cfg: MlflowConfig, params: dict[str, Any], output_dir: str, run_name: str):
        import mlflow
        from ray.air.integrations.mlflow import setup_mlflow

        _allow_file_store(cfg.tracking_uri)
        _ensure_experiment(cfg)
        mlflow.set_tracking_uri(cfg.tracking_uri)
        if mlflow.active_run() is not None:  # left open by a failed run in this process
            mlflow.end_run(status="FAILED")
        previous = _existing_mlflow_run(cfg, read_record(output_dir).get("mlflow"))
        have = previous.data.params if previous else {}
        texts = {mlflow_key(k): param_text(v) for k, v in params.items()}
        new = {k: v for k, v in texts.items() if k not in have}
        self.changed = sorted(k for k, v in texts.items() if k in have and have[k] != v)
        # setup_mlflow has no run id argument; mlflow.start_run resumes the run MLFLOW_RUN_ID names.
        # Params are immutable in MLflow: a resumed run gets only the ones it lacks.
        with environment({"MLFLOW_RUN_ID": previous.info.run_id if previous else None}):
            # rank_zero_only=False: only rank 0 gets here, and the local backend has no Train context.
            self.mlflow = setup_mlflow(config=new,
                                       tracking_uri=cfg.tracking_uri, experiment_name=cfg.experiment,
                                       run_name=cfg.run_name or run_name, create_experiment_if_not_exists=True,
                                       tags=dict(cfg.tags), rank_zero_only=False)
        info = self.mlflow.active_run().info
        self.run_id, self.resumed = info.run_id, previous is not None
        _record(output_dir, "mlflow", {"tracking_uri": cfg.tracking_uri, "experiment": cfg.experiment,
                                       "experiment_id": info.experiment_id, "run_id": info.run_id})
        self.line = (f"MLflow run {info.run_id} ({'resumed' if self.resumed else 'new'}) in experiment "
                     f"{cfg.experiment!r}" + (f"; changed params kept as first logged: {', '.join(self.changed)}"
                                              if self.changed else ""))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({mlflow_key(k): float(v) for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _finish_mlflow(cfg: MlflowConfig, record: dict[str, Any], params: dict[str, Any], scores: dict[str, float],
                   step: int, model_dir: str | None) -> str:
    import time

    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.tracking import MlflowClient

    _allow_file_store(cfg.tracking_uri)
    # A client on the recorded run id, not the fluent API: the driver may finish several runs
    # (a Zeshel grid) in one process, and must not leave one of them active.
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    run_id = record["run_id"]
    have = client.get_run(run_id).data.params
    texts = {mlflow_key(k): param_text(v) for k, v in params.items()}
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in scores.items()],
                     params=[Param(k, v) for k, v in texts.items() if k not in have])
    logged = model_dir is not None and cfg.log_model
    if logged:
        client.log_artifacts(run_id, model_dir, artifact_path="model")
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    return f"MLflow run {run_id}: {len(scores)} summary scores" + (", model artifact" if logged else "")


# ---------------------------------------------------------------------------- W&B

def _wandb_id(cfg: WandbConfig, output_dir: str) -> tuple[str, bool]:
    """The recorded run id when it is for this project and entity, else a new one (recorded now)."""
    record = read_record(output_dir).get("wandb") or {}
    if record.get("project") == cfg.project and record.get("entity") == cfg.entity and record.get("id"):
        return record["id"], True
    run_id = uuid.uuid4().hex[:16]
    _record(output_dir, "wandb", {"project": cfg.project, "entity": cfg.entity, "id": run_id})
    return run_id, False


def _open_wandb(cfg: WandbConfig, config: dict[str, Any], output_dir: str, run_name: str, run_id: str):
    from ray.air.integrations.wandb import setup_wandb

    directory = cfg.dir or output_dir
    Path(directory).mkdir(parents=True, exist_ok=True)
    # Ray's API-key check reads WANDB_MODE from the environment, not the mode argument.
    with environment({"WANDB_MODE": cfg.mode}):
        return setup_wandb(config=config, rank_zero_only=False, project=cfg.project, entity=cfg.entity,
                           group=cfg.group, name=cfg.name or run_name, tags=list(cfg.tags), mode=cfg.mode,
                           dir=directory, id=run_id, resume="allow",
                           # Ray already collects the workers' output; W&B's console capture would
                           # wrap the same streams again.
                           settings={"console": "off"})


class WandbRun:
    """Rank 0's W&B run, opened by Ray's ``setup_wandb`` with the recorded id."""

    def __init__(self, cfg: WandbConfig, params: dict[str, Any], output_dir: str, run_name: str):
        run_id, self.resumed = _wandb_id(cfg, output_dir)
        self.run = _open_wandb(cfg, params, output_dir, run_name, run_id)
        self.line = f"W&B run {run_id} ({'resumed' if self.resumed else 'new'}, {cfg.mode}) in project {cfg.project!r}"

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({k: float(v) for k, v in values.items()}, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb-core has closed the run's stream, which is when it writes the
        # run's file out (offline: the only copy), and Ray Train ends its workers with ray.kill, which
        # runs no atexit hook (W&B's own teardown): wait for W&B here.
        wandb.teardown()


def _finish_wandb(cfg: WandbConfig, record: dict[str, Any], params: dict[str, Any], scores: dict[str, float],
                  output_dir: str, run_name: str, model_dir: str | None) -> str:
    import wandb

    run = _open_wandb(cfg, params, output_dir, run_name, record["id"])
    run.summary.update(scores)
    logged = model_dir is not None and cfg.log_model
    if logged:
        # Artifact names take letters, digits, '-', '_' and '.'.
        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{cfg.name or run_name}-model"), type="model")
        artifact.add_dir(model_dir)
        run.log_artifact(artifact)
    run.finish()
    return f"W&B run {record['id']}: {len(scores)} summary scores" + (", model artifact" if logged else "")


# ---------------------------------------------------------------------------- the two sides

class Tracker:
    """What :class:`~dist_nce.worker.tb.RunLogger` calls on rank 0: every open run, alike."""

    def __init__(self, runs: list[MlflowRun | WandbRun]):
        self.runs = runs
        self.lines = [r.line for r in runs]

    def log(self, step: int, values: dict[str, float]) -> None:
        for r in self.runs:
            r.log(step, values)

    def close(self) -> None:
        for r in self.runs:
            r.close()


def start_tracking(tracking: TrackingConfig, config: dict[str, Any], output_dir: str, run_name: str
                   ) -> Tracker | None:
    """Rank 0's trackers for a run (``config``: the job config as a dict), or None when
    ``run.tracking`` is off (nothing imported)."""
    if not tracking.enabled:
        return None
    params = params_of(config)
    runs: list[MlflowRun | WandbRun] = []
    if tracking.mlflow.enabled:
        runs.append(MlflowRun(tracking.mlflow, params, output_dir, run_name))
    if tracking.wandb.enabled:
        runs.append(WandbRun(tracking.wandb, params, output_dir, run_name))
    return Tracker(runs)


def finish_tracking(tracking: TrackingConfig, output_dir: str, run_name: str, summary: dict[str, Any],
                    model_dir: str | None, log: Callable[[str], None] = print) -> None:
    """The driver's end of a tracked run, after summary.json: the summary's scores, the config
    params the worker did not log, the model directory (when exported) as an artifact."""
    if not tracking.enabled:
        return
    record = read_record(output_dir)
    params, scores = params_of(summary.get("config") or {}), summary_scores(summary)
    step = int(summary.get("step") or 0)
    model_dir = model_dir if model_dir and Path(model_dir).is_dir() else None
    for name, enabled, finish in (
            ("mlflow", tracking.mlflow.enabled,
             lambda r: _finish_mlflow(tracking.mlflow, r, params, scores, step, model_dir)),
            ("wandb", tracking.wandb.enabled,
             lambda r: _finish_wandb(tracking.wandb, r, params, scores, output_dir, run_name, model_dir))):
        if not enabled:
            continue
        if not record.get(name):
            log(f"tracking: no {name} run recorded in {Path(output_dir) / RECORD} (the workers never opened "
                "one): final scores not logged")
            continue
        log("tracking: " + finish(record[name]))


def missing_packages(tracking: TrackingConfig) -> list[str]:
    """``run.tracking.<x>: ...`` for each enabled tracker whose package is not installed
    (checked on the driver before any cluster work, without importing it)."""
    from importlib.util import find_spec

    def installed(name: str) -> bool:
        try:
            return find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a half-removed module
            return False

    out = []
    for name, enabled in (("mlflow", tracking.mlflow.enabled), ("wandb", tracking.wandb.enabled)):
        if enabled and not installed(name):
            out.append(f"run.tracking.{name}: enabled, but {name} is not installed (pip install -e '.[{name}]')")
    return out
