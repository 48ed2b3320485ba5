"""The driver's side of one retriever training run, shared by the AIDA and Zeshel jobs.

The cluster must hold the shards and the workers together -> a NegativeService over the
store -> index version 0 from the initial weights -> the plan printed -> training (resumes a
run with the same name and storage_path) -> the summary -> the KB snapshot of the final
index. What differs between the jobs comes in as arguments: the store the shards serve, the
config the summary records, the plan's heading, fields of the job's own, and whether KB
deltas asked for during training are served (:class:`~dist_nce.train.kb_control.KbWatcher`).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import ray

from dist_nce.actors.service import NegativeService
from dist_nce.cluster.fit import check_fits, service_request, workers_request
from dist_nce.cluster.runtime import init_ray
from dist_nce.train.config import TrainJobConfig
from dist_nce.train.kb_control import KbWatcher
from dist_nce.train.model import build_retriever
from dist_nce.train.trainer import describe_plan, fit, kb_delta_note, kb_snapshot, plan_for, unflatten, use_gpu


def run_training(cfg: TrainJobConfig, store: str, *, config: dict[str, Any],
                 heading: Callable[[NegativeService], str], log: Callable[[str], None] = print,
                 fields: Mapping[str, Any] | None = None, started: float | None = None,
                 watch_kb: bool = False) -> dict[str, Any]:
    """Train on ``store`` with negatives from its shards; the run's summary (not written here).

    ``config``: the summary's ``config`` (the job's own, which may hold more than the
    trainer's ``cfg``); ``heading``: the line above the printed plan; ``fields``: the job's
    own summary fields, after ``step``; ``started``: ``time.perf_counter()`` at the job's
    start, when the summary's ``seconds`` count up to the end of training; ``watch_kb``: serve
    the KB deltas asked for through ``<run.output_dir>/kb_update.json`` while training runs.
    Raises :class:`~dist_nce.cluster.fit.DoesNotFit` before any shard starts.
    """
    init_ray()
    # Shards and workers must fit the cluster together, or Ray Train waits for workers it cannot place,
    # then times out.
    check_fits([service_request(cfg.service), workers_request(cfg.run, use_gpu(cfg))], ray.cluster_resources())
    service = NegativeService.create(store, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    try:  # a failed or interrupted run must not leave the shards holding the cluster
        retriever = build_retriever(cfg.model, cfg.optim.seed)
        version = service.ensure_encoded(ray.put(retriever.entity_encoder_state()), version=0)
        del retriever
        plan = plan_for(cfg)
        log(heading(service) + "\n" + describe_plan(cfg, plan, service.ranges, version, use_gpu(cfg)))
        if note := kb_delta_note(cfg):
            log(note)
        watcher = KbWatcher(service, cfg.run.output_dir, log=log) if watch_kb else None
        with watcher or contextlib.nullcontext():
            final = unflatten(fit(cfg, service).metrics or {})
        summary: dict[str, Any] = {
            "config": config, "plan": plan.as_dict(), "done": bool(final.get("done")), "step": final.get("step"),
            **(fields or {}), "dev_before": final.get("dev_before"), "dev_after": final.get("dev_after"),
            "index_version": final.get("index_version"), "export": final.get("export")}
        if started is not None:
            summary["seconds"] = round(time.perf_counter() - started, 1)
        summary["engine"] = final.get("engine")  # device, DeepSpeed accelerator, ZeRO stage, bf16
        if watcher is not None:
            summary.update(kb_version=service.kb_version, kb_updates=watcher.outcomes)
        # The path may be inside Ray's temporary copy of the working directory: keep the content.
        summary["deepspeed_config"] = json.loads(Path(cfg.deepspeed.config).read_text(encoding="utf-8"))
        if summary["done"] and cfg.run.export:  # where the final KB embeddings live (the shards persisted them)
            summary["kb_snapshot"] = kb_snapshot(service, cfg, Path(cfg.run.output_dir) / "kb_snapshot")
        return summary
    finally:
        service.shutdown()
