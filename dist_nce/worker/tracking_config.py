"""``run.tracking``: where a training run also reports, besides TensorBoard and metrics.jsonl.

Both trackers are off by default; turning one on (``enabled: true``) makes rank 0 log through
Ray's integration for it (:mod:`dist_nce.worker.tracking`, docs/tracking.md). This module only
declares the settings: importing it imports neither MLflow nor W&B.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Optional


def _help(text: str, check=None, **kw):
    """A field with its help string (dist_nce.core.config); these settings have no numbers."""
    return field(metadata={"help": text, **({"check": check} if check else {})}, **kw)


def tracking_uri_problem(value: str) -> str | None:
    """A ``check``: workers run in another working directory, so a local store needs an
    absolute location; a URI (``file:///abs``, ``http://host:5000``, ``databricks``) is taken as is."""
    if "://" in value or value.startswith("databricks") or os.path.isabs(value):
        return None
    return ("must be a URI (file:///absolute/mlruns, http://host:5000, databricks) or an absolute path: "
            "Ray Train workers run in another working directory")


@dataclass
class MlflowConfig:
    enabled: bool = _help("Log this run to MLflow (ray.air.integrations.mlflow.setup_mlflow on rank 0).",
                          default=False)
    tracking_uri: Optional[str] = _help(
        "MLflow tracking URI: http(s)://server, databricks, or a local file store file:///absolute/mlruns "
        "(reachable from every worker; MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true, "
        "which a file: URI here sets in the processes that log). Required when enabled.",
        check=tracking_uri_problem, default=None)
    experiment: str = _help("Experiment name (created when missing).", default="dist-nce")
    run_name: Optional[str] = _help("MLflow run name (default: run.name).", default=None)
    tags: dict[str, str] = _help("Tags set on the MLflow run.", default_factory=dict)
    log_model: bool = _help("Log the exported model directory as the run's `model` artifact at the end.",
                            default=True)

    def validate(self) -> None:
        if self.enabled and not self.tracking_uri:
            raise ValueError("tracking_uri: required when enabled (file:///absolute/mlruns or http://host:5000)")


@dataclass
class WandbConfig:
    enabled: bool = _help("Log this run to Weights & Biases (ray.air.integrations.wandb.setup_wandb on rank 0).",
                          default=False)
    project: str = _help("W&B project.", default="dist-nce")
    entity: Optional[str] = _help("W&B entity (user or team; default: the API key's default entity).",
                                  default=None)
    group: Optional[str] = _help("W&B run group (e.g. one grid's cells).", default=None)
    name: Optional[str] = _help("W&B run display name (default: run.name).", default=None)
    tags: list[str] = _help("W&B run tags.", default_factory=list)
    mode: Literal["online", "offline", "disabled"] = _help(
        "online: stream to the W&B server (WANDB_API_KEY on the workers); offline: write the run under dir, "
        "upload later with `wandb sync`; disabled: W&B's no-op run.", default="online")
    dir: Optional[str] = _help("Directory W&B writes its wandb/ folder into (default: run.output_dir).",
                               default=None)
    log_model: bool = _help("Log the exported model directory as a `model` artifact at the end.", default=True)


@dataclass
class TrackingConfig:
    mlflow: MlflowConfig = _help("MLflow (the `mlflow` extra: pip install -e '.[mlflow]').",
                                 default_factory=MlflowConfig)
    wandb: WandbConfig = _help("Weights & Biases (the `wandb` extra: pip install -e '.[wandb]').",
                               default_factory=WandbConfig)

    @property
    def enabled(self) -> bool:
        return self.mlflow.enabled or self.wandb.enabled
