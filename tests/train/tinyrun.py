"""Shared set-up of the Ray tests: a prepared synthetic KB for the tiny test config, and the
driver side of jobs/aida_finetune.py to train it."""
from __future__ import annotations

from pathlib import Path

from dist_nce.core.config import load_config
from dist_nce.train.config import TrainJobConfig, with_absolute_paths
from dist_nce.worker.tb import read_metrics

REPO = Path(__file__).resolve().parents[2]
TEST_CONFIG = REPO / "configs" / "aida" / "test_tiny.yaml"


def tiny_overrides(root: Path, model_dir: str) -> list[str]:
    """--set overrides pointing configs/aida/test_tiny.yaml at ``root`` and the tiny model."""
    return [f"model.retriever.mention_model={model_dir}", f"data.prepared_dir={root / 'prepared'}",
            f"data.synthetic_dir={root / 'synthetic'}"]


def tiny_config(root: Path, model_dir: str, run_dir: Path, *extra: str) -> TrainJobConfig:
    cfg = load_config(TrainJobConfig, TEST_CONFIG, [
        *tiny_overrides(root, model_dir), f"run.output_dir={run_dir / 'out'}",
        f"run.storage_path={run_dir / 'ray'}", *extra])
    return with_absolute_paths(cfg, str(REPO))


def prepare_tiny(root: Path, model_dir: str) -> TrainJobConfig:
    from dist_nce.train.data import ensure_prepared

    cfg = tiny_config(root, model_dir, root / "unused")
    ensure_prepared(cfg.data, model_dir, log=lambda s: None)
    return cfg


def train(cfg: TrainJobConfig, during=None):
    """The driver side of jobs/aida_finetune.py: service + index version 0, fit, shut the shards
    down; ``during(service)`` runs once version 0 is served. Returns the final metrics and the
    shards' status at the end."""
    import ray

    from dist_nce.actors.service import NegativeService
    from dist_nce.train.model import build_retriever
    from dist_nce.train.trainer import fit, unflatten

    service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    try:
        service.ensure_encoded(ray.put(build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state()))
        if during:
            during(service)
        return unflatten(fit(cfg, service).metrics), service.status()
    finally:
        service.shutdown()


def losses(cfg: TrainJobConfig) -> dict[int, float]:
    """{step: train/loss} of a run (the last line of a step re-trained after a restart)."""
    return {s: v["train/loss"] for s, v in read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl").items()
            if "train/loss" in v}
