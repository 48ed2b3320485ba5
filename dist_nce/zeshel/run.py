"""One Zeshel retriever run, as a story: data -> service -> train -> evaluate -> candidates.

``dist_nce.cli.zeshel_retriever`` parses the command line and calls :func:`run_retriever`;
``dist_nce.cli.zeshel_grid`` calls it once per grid cell inside one Ray session. Training is
the AIDA job's driver (:func:`dist_nce.train.driver.run_training`) over the train worlds'
store, with negatives from the NegativeService's shards over that store.
"""
from __future__ import annotations

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
    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.modeling.retriever import Retriever
    from dist_nce.train.config import check_inputs
    from dist_nce.train.driver import run_training
    from dist_nce.train.model import MODEL_DIR
    from dist_nce.train.trainer import check_prepared
    from dist_nce.worker.tracking import finish_tracking
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.evaluate import evaluate_retriever, recall_table

    start = time.perf_counter()
    # 1. data: the train worlds' store (trainer, shards) and the val/test worlds' store
    train_store, eval_store = ensure_zeshel_stores(cfg, log)
    train_cfg = training_config(cfg)
    check_inputs(train_cfg, aida=False)  # now against the prepared store's splits
    check_prepared(train_cfg, train_store)  # K and shards within its entities, a rerun's checkpoints: before Ray
    # 2. train with the service over the TRAIN worlds only: every negative is a training-world entity
    summary = run_training(
        train_cfg, train_store, config=to_dict(cfg), log=log, fields={"dev_split": cfg.data.dev_split},
        heading=lambda service: f"run {cfg.run.name} (Zeshel; negatives from {service.num_entities:,} "
                                "train-world entities):")
    # 3. evaluation and candidates files from the exported model
    if summary["done"]:
        model = Retriever.from_pretrained(Path(cfg.run.output_dir) / MODEL_DIR).to(_device(cfg.zeshel.eval_device))
        out = candidates_dir(cfg)
        summary["zeshel"] = evaluate_retriever(model, train_store, eval_store, cfg.zeshel, out, progress, log)
        summary["candidates_dir"] = out
        log(f"top-{cfg.zeshel.k} recall (own_world: the mention's world only, the Zeshel protocol; split_union: "
            f"all worlds of the split):\n" + recall_table(summary["zeshel"], cfg.zeshel.k))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    atomic_write_json(Path(cfg.run.output_dir) / SUMMARY, summary)
    # 4. run.tracking: the recall and the model into the run the workers opened
    finish_tracking(cfg.run.tracking, cfg.run.output_dir, cfg.run.name, summary,
                    (summary.get("export") or {}).get("model"), log)
    return summary
