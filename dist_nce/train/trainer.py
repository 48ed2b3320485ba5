"""Driver side of training: TorchTrainer wiring, the printed plan, the run summary.

The driver owns the NegativeService (created once, index version 0 encoded before
training) and passes it to the workers in ``train_loop_config``: actor handles pickle,
so every worker talks to the same shards and no worker creates any.
"""
from __future__ import annotations

import json
import os
from typing import Any

from dist_nce.actors.protocols import NegativeSource
from dist_nce.core.config import to_dict
from dist_nce.train.config import TrainJobConfig
from dist_nce.train.plan import ORDER_KB_VERSION, TrainPlan
from dist_nce.worker.launch import fit_and_release, make_torch_trainer, storage_uri, use_gpu  # noqa: F401 (re-exported)


def order_kb_version(cfg: TrainJobConfig) -> int:
    """The KB version whose golds give the run's data order (``TrainPlan.order_kb_version``): that of the
    checkpoint a rerun resumes from (:func:`~dist_nce.worker.launch.resume_point`; 0 for one written before
    plans kept it), else the store's current one. The workers read a checkpoint's own plan (a remote storage
    too); this is what a fresh run's workers are given, and what the driver prints and checks."""
    from dist_nce.core.artifacts import read_manifest
    from dist_nce.worker.checkpoint import KIND
    from dist_nce.worker.launch import resume_point
    from kb.store import EntityStore

    point = resume_point(storage_uri(cfg.run.storage_path), cfg.run.name)
    if point is not None:
        try:
            return int(read_manifest(point[1], KIND).get("plan", {}).get("order_kb_version", 0))
        except (OSError, ValueError):  # gone or unreadable: the workers' own reading is what counts
            pass
    return EntityStore(cfg.data.prepared_dir).kb_version


def make_trainer(cfg: TrainJobConfig, service: NegativeSource):
    """A TorchTrainer running :func:`dist_nce.train.loop.train_func` on ``run.num_workers`` workers."""
    from dist_nce.train.loop import train_func

    return make_torch_trainer(train_func, cfg, {"job": to_dict(cfg), "service": service,
                                                ORDER_KB_VERSION: order_kb_version(cfg)})


def fit(cfg: TrainJobConfig, service: NegativeSource):
    """Train (or resume: same run.name and storage_path); returns the ray.train Result."""
    return fit_and_release(make_trainer(cfg, service))


def describe_plan(cfg: TrainJobConfig, plan: TrainPlan, ranges: list[tuple[int, int]], version: int,
                  gpu: bool) -> str:
    """The derived quantities of a run, printed before it starts."""
    ds = json.loads(open(cfg.deepspeed.config, encoding="utf-8").read())
    stage = cfg.deepspeed.zero_stage if cfg.deepspeed.zero_stage is not None else \
        ds.get("zero_optimization", {}).get("stage", 0)
    bf16 = cfg.deepspeed.bf16 if cfg.deepspeed.bf16 is not None else ds.get("bf16", {}).get("enabled", False)
    sizes = [b - a for a, b in ranges]
    n, neg = cfg.negatives, plan.num_candidates - 1
    refresh = ("never (frozen entity encoder)" if cfg.model.freeze_entity_encoder else
               "never" if cfg.refresh.mode == "never" else
               f"{cfg.refresh.mode}, every {cfg.refresh.every_steps or '-'} steps"
               f"{', at epoch starts' if cfg.refresh.at_epoch_start else ''}")
    stop = f" (this job stops after step {cfg.run.stop_after_steps})" if cfg.run.stop_after_steps else ""
    product = plan.steps_per_epoch * plan.epochs  # more than total_steps when optim.max_steps cut the last epoch
    lines = [
        f"model: {cfg.model.retriever.preset}{'-' + str(cfg.model.retriever.m) if cfg.model.retriever.m else ''} "
        f"from {cfg.model.blink_checkpoint or cfg.model.init_from or cfg.model.retriever.mention_model or 'MiniLM'}",
        f"workers: {plan.num_workers} x DeepSpeed ZeRO-{stage} {'bf16' if bf16 else 'fp32'} on "
        f"{'GPU (NCCL)' if gpu else 'CPU (gloo)'}",
        f"global batch: {plan.global_batch} mentions = {plan.num_workers} workers x {plan.per_worker_batch}",
        f"candidates per mention: K = {plan.num_candidates} = gold + {neg} negatives "
        f"({plan.n_hard} hard + {plan.n_random} random; mode {n.mode}"
        f"{f', p={n.p:g}' if n.mode == 'mixed' else ''}; {n.schedule}"
        f"{f', prefetch {n.prefetch}' if n.schedule == 'pipelined' else ''})",
        f"entities: {plan.num_entities:,} in {len(ranges)} shards ({min(sizes):,}-{max(sizes):,} per shard)",
        f"training mentions: {plan.train_mentions:,} of {plan.split_mentions:,} "
        f"({plan.excluded_missing_gold:,} excluded: gold not in the KB)",
        f"steps: {plan.steps_per_epoch:,} per epoch x {plan.epochs} epochs"
        f"{' = ' if product == plan.total_steps else ', capped by optim.max_steps at '}{plan.total_steps:,}{stop}",
        f"index version: {version}; refresh: {refresh}",
    ]
    return "\n".join("  " + line for line in lines)


def dev_table(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """Before / after / change of every dev metric, as a fixed-width table."""
    keys = [k for k in (after or before or {}) if k.startswith(("recall@", "accuracy"))]
    # accuracy, then recall@k by k: a dict read back from summary.json has its keys sorted as text (@16 < @4)
    keys.sort(key=lambda k: (k.startswith("recall@"), int(k[7:]) if k[7:].isdigit() else 0, k))
    n = (after or before or {}).get("n_mentions", "?")
    rows = [f"{'dev (' + str(n) + ' mentions)':<22}{'before':>10}{'after':>10}{'change':>10}"]
    for k in keys:
        b = None if before is None else before.get(k)
        a = None if after is None else after.get(k)
        fmt = lambda v: f"{v:10.4f}" if v is not None else f"{'-':>10}"  # noqa: E731
        change = f"{a - b:+10.4f}" if a is not None and b is not None else f"{'-':>10}"
        rows.append(f"{k:<22}{fmt(b)}{fmt(a)}{change}")
    return "\n".join(rows)


def unflatten(metrics: dict[str, Any]) -> dict[str, Any]:
    """{"a/b": v} -> {"a": {"b": v}} (inverse of the worker's final report flattening)."""
    out: dict[str, Any] = {}
    for key, v in metrics.items():
        cur = out
        *path, last = key.split("/")
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = v
    return out


def kb_delta_note(cfg: TrainJobConfig, order: int | None = None) -> str:
    """What a run's data order leaves out of a store changed by KB deltas since the KB version it comes from
    (``order``, default :func:`order_kb_version`: a resumed run keeps the one it started at), said before the
    run starts, or "" when there is nothing. A training mention whose gold a later delta added is not
    trained on in this run; one whose gold a later delta removed is skipped per batch (``train.kb_follow``)."""
    import numpy as np

    from dist_nce.train.plan import eligible_mentions
    from kb.store import MentionTable

    order = order_kb_version(cfg) if order is None else order
    train = MentionTable(cfg.data.prepared_dir, cfg.data.train_split)
    if train.kb_version == order:
        return ""
    then, _ = eligible_mentions(MentionTable(cfg.data.prepared_dir, cfg.data.train_split, kb_version=order).gold_rows,
                                cfg.data.max_train_mentions)
    now, _ = eligible_mentions(train.gold_rows, cfg.data.max_train_mentions)
    added, removed = len(np.setdiff1d(now, then)), len(np.setdiff1d(then, now))
    if not added and not removed:
        return ""
    parts = [f"whose gold a later delta added, not trained on in this run: {added:,}"] if added else []
    parts += [f"whose gold a later delta removed, skipped when their batch comes: {removed:,}"] if removed else []
    return (f"KB version {train.kb_version}: this run's data order comes from the golds of KB version {order}, "
            f"where it started (so that it resumes exactly); training mentions {'; '.join(parts)}. A new run "
            "(another run.name) trains on the KB as it is now")


def plan_for(cfg: TrainJobConfig, order: int | None = None) -> TrainPlan:
    """The plan of ``cfg`` over its prepared KB (what the workers will compute too), its data order from the
    golds of KB version ``order`` (default :func:`order_kb_version`)."""
    from kb.store import EntityStore, MentionTable

    from dist_nce.index.encode import store_fingerprint
    from dist_nce.train.plan import make_plan

    order = order_kb_version(cfg) if order is None else order
    store = EntityStore(cfg.data.prepared_dir)
    train = MentionTable(cfg.data.prepared_dir, cfg.data.train_split, kb_version=order)
    return make_plan(cfg, train.gold_rows, store.num_entities, store_fingerprint(cfg.data.prepared_dir), order)


def check_resume(cfg: TrainJobConfig) -> None:
    """Refuse, before Ray starts, a rerun that could not resume its own checkpoints: the plan of ``cfg``
    over the store as it is now (:func:`plan_for`) against that of the checkpoint the rerun would resume
    from (a changed KB, batch or worker count; :func:`~dist_nce.worker.launch.check_rerun`). Without it
    the workers find out, each restart (``run.max_failures``) logging their tracebacks, after the shards
    have encoded the KB."""
    from dist_nce.core.config import ConfigError
    from dist_nce.worker.launch import check_rerun, storage_uri

    try:
        check_rerun(storage_uri(cfg.run.storage_path), cfg.run.name, lambda: plan_for(cfg).as_dict())
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_prepared(cfg: TrainJobConfig, store_dir: str) -> None:
    """What a run checks once its store is prepared, before Ray starts: K and the shard count within the
    store's entities (:func:`~dist_nce.train.config.check_against_store`), and a rerun's checkpoints
    (:func:`check_resume`). Raises ValueError (ConfigError) naming the key."""
    from dist_nce.train.config import check_against_store

    check_against_store(cfg, store_dir)
    check_resume(cfg)


def check_existing_store(cfg: TrainJobConfig) -> None:
    """For ``--dry-run``, which prepares nothing: :func:`check_prepared` against ``data.prepared_dir`` as
    it is now, if it exists. Before, a dry run said OK to settings the run then refused at once. Raises
    ConfigError saying which store it checked (a run that prepares the store again checks the new one)."""
    from pathlib import Path

    from dist_nce.core.config import ConfigError

    store = Path(cfg.data.prepared_dir)
    if not (store / "manifest.json").is_file():
        return
    try:
        check_prepared(cfg, str(store))
    except ValueError as e:
        raise ConfigError(f"{e}\n  (checked against the prepared store as it is now, {store})") from None


def kb_snapshot(service: NegativeSource, cfg: TrainJobConfig, directory: str | os.PathLike) -> dict[str, Any]:
    """Export the KB encoded with the final weights (``index.export.export_snapshot``: embeddings.npy,
    ids.txt, manifest) from the version the shards serve and persisted after the final refresh."""
    from pathlib import Path

    from kb.store import EntityStore

    from dist_nce.index.export import export_snapshot
    from dist_nce.index.versions import shard_dir_name, version_dir_name

    status = service.status()
    if any(s.get("kb_version") for s in status):
        # The snapshot format covers the shards' base ranges only; after KB deltas it would miss the added
        # rows and keep the removed ones. Say so rather than export a wrong KB.
        return {"skipped": "the shards serve a KB changed by deltas (kb_version > 0): a snapshot of it is not "
                           "supported yet; compact the store (jobs/update_kb.py --compact) and encode the "
                           "compacted one with jobs/encode_kb.py"}
    version = min(s["served"] for s in status)
    root = Path(cfg.service.shard_dir or Path(cfg.run.output_dir) / "shards")
    parts = []
    for s in status:
        path = root / shard_dir_name(s["shard"], len(status)) / version_dir_name(version)
        if version not in s["persisted"]:
            raise RuntimeError(f"shard {s['shard']}: version {version} is not persisted under {path.parent}")
        parts.append((tuple(s["rows"]), path))
    return export_snapshot(directory, EntityStore(cfg.data.prepared_dir), parts, version=version,
                           model=str(Path(cfg.run.output_dir) / "model"), retriever=to_dict(cfg.model.retriever))
