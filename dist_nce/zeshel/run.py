"""One Zeshel retriever run, as a story: data -> service -> train -> evaluate -> candidates.

``jobs/zeshel_retriever.py`` parses the command line and calls :func:`run_retriever`;
``jobs/zeshel_grid.py`` calls it once per grid cell inside one Ray session. Training is
the AIDA trainer's (``dist_nce.train.trainer.fit``) over the train worlds' store, with
negatives from the NegativeService's shards over that store.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from dist_nce.core.config import to_dict
from dist_nce.zeshel.config import ZeshelRetrieverConfig, candidates_dir, training_config

SUMMARY = "summary.json"


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def run_retriever(cfg: ZeshelRetrieverConfig, progress: bool = True, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """Train (or resume) and evaluate; writes ``<run.output_dir>/summary.json`` and returns it.

    ``cfg`` must have absolute paths (:func:`dist_nce.zeshel.config.absolute`): Ray Train
    workers run in another directory.
    """
    import ray

    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.cluster.fit import check_fits, service_request, workers_request
    from dist_nce.actors.service import NegativeService
    from dist_nce.modeling.retriever import Retriever
    from dist_nce.cluster.runtime import init_ray
    from dist_nce.train.config import check_against_store, check_inputs
    from dist_nce.train.model import MODEL_DIR, build_retriever
    from dist_nce.train.trainer import describe_plan, fit, kb_snapshot, plan_for, unflatten, use_gpu
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.evaluate import evaluate_retriever, recall_table

    start = time.perf_counter()
    # 1. data: the train worlds' store (trainer, shards) and the val/test worlds' store
    train_store, eval_store = ensure_zeshel_stores(cfg, log)
    train_cfg = training_config(cfg)
    check_inputs(train_cfg)  # now against the prepared store's splits
    check_against_store(train_cfg, train_store)  # K and shards within its entities, before Ray starts
    # 2. the service over the TRAIN worlds only: every negative is a training-world entity
    init_ray()
    # Shards and workers must fit the cluster together (else Ray Train waits, then times out).
    check_fits([service_request(cfg.service), workers_request(cfg.run, use_gpu(train_cfg))], ray.cluster_resources())
    service = NegativeService.create(train_store, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    try:
        retriever = build_retriever(cfg.model, cfg.optim.seed)
        version = service.ensure_encoded(ray.put(retriever.entity_encoder_state()), version=0)
        del retriever
        plan = plan_for(train_cfg)
        log(f"run {cfg.run.name} (Zeshel; negatives from {service.num_entities:,} train-world entities):\n"
            + describe_plan(train_cfg, plan, service.ranges, version, use_gpu(train_cfg)))
        # 3. train (resumes a run with the same name + storage_path)
        final = unflatten(fit(train_cfg, service).metrics or {})
        summary: dict[str, Any] = {
            "config": to_dict(cfg), "plan": plan.as_dict(), "done": bool(final.get("done")), "step": final.get("step"),
            "dev_split": cfg.data.dev_split, "dev_before": final.get("dev_before"), "dev_after": final.get("dev_after"),
            "index_version": final.get("index_version"), "export": final.get("export"),
            "engine": final.get("engine"),  # device, DeepSpeed accelerator, ZeRO stage, bf16
            # The path may be inside Ray's temporary copy of the working directory: keep the content.
            "deepspeed_config": json.loads(Path(cfg.deepspeed.config).read_text(encoding="utf-8"))}
        if summary["done"]:
            summary["kb_snapshot"] = kb_snapshot(service, train_cfg, Path(cfg.run.output_dir) / "kb_snapshot")
    finally:
        service.shutdown()
    # 4. evaluation and candidates files from the exported model
    if summary["done"]:
        model = Retriever.from_pretrained(Path(cfg.run.output_dir) / MODEL_DIR).to(_device(cfg.zeshel.eval_device))
        out = candidates_dir(cfg)
        summary["zeshel"] = evaluate_retriever(model, train_store, eval_store, cfg.zeshel, out, progress, log)
        summary["candidates_dir"] = out
        log(f"top-{cfg.zeshel.k} recall (own_world: the mention's world only, the Zeshel protocol; split_union: "
            f"all worlds of the split):\n" + recall_table(summary["zeshel"], cfg.zeshel.k))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    atomic_write_json(Path(cfg.run.output_dir) / SUMMARY, summary)
    return summary
