"""Finetune an entity-linking retriever on AIDA (KILT) with hard-negative NCE.

Prepares the KB (synthetic data when configured), starts the sharded NegativeService and
encodes index version 0, trains with Ray Train + DeepSpeed (dist_nce/train/), evaluates
on dev before and after, exports the model (Hugging Face + BLINK layout) and the KB
snapshot, and writes ``<run.output_dir>/summary.json``.

On a Ray cluster (here: a head started with ``ray start --head`` with token authentication
on: README "Running on a cluster"; the client needs ``RAY_AUTH_MODE=token`` and the token)::

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/aida_finetune.py --config configs/aida/tiny_cpu.yaml

Without a cluster (starts a local Ray)::

    .venv/bin/python jobs/aida_finetune.py --config configs/aida/tiny_cpu.yaml
    .venv/bin/python jobs/aida_finetune.py --config configs/aida/tiny_cpu.yaml --set optim.lr=1e-4 \\
        --set negatives.mode=mixed --set negatives.p=50

The paper's set-up on GPUs (KubeRay: configs/cluster/kuberay/rayjob.yaml)::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/aida_finetune.py \\
        --config configs/aida/paper_dual_p50.yaml --set run.storage_path=/mnt/shared/ray_results \\
        --set data.prepared_dir=/mnt/shared/kb/kilt_blink

Running the same command again resumes the run (same run.name and run.storage_path) from
its last checkpoint. Relative paths in the config resolve against the working directory
(under ``--working-dir .`` that is Ray's copy of it): give absolute paths, on shared
storage for multi-node clusters, for data and outputs you want to keep. Every config
field: ``--help-config``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run from a checkout (also under `ray job submit --working-dir .`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_nce.core.config import ConfigError, describe, load_config, to_dict  # noqa: E402
from dist_nce.core.models import ensure_tiny_models  # noqa: E402
from dist_nce.train.config import TrainJobConfig, check_against_store, check_inputs, with_absolute_paths  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="experiment YAML (configs/aida/*.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the config and every input path, then exit (no data generation, no Ray)")
    ap.add_argument("--help-config", action="store_true", help="print every config field and exit")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe(TrainJobConfig))
        return 0
    if not args.config:
        ap.error("--config is required")
    # 1. config: every key and every input path checked before any cluster work
    try:
        cfg = with_absolute_paths(load_config(TrainJobConfig, args.config, args.set))
        # A config naming the project's tiny-model path (data/models/tiny_bert) runs from a fresh
        # clone: the random tiny BERT is built there on first use, before the input checks.
        ensure_tiny_models({"model.retriever.mention_model": cfg.model.retriever.mention_model,
                            "model.retriever.entity_model": cfg.model.retriever.entity_model})
        check_inputs(cfg)
    except (ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"{args.config}: config and inputs OK (dry run: nothing generated, no Ray started)")
        return 0
    start = time.perf_counter()

    import ray

    from dist_nce.core.artifacts import ArtifactMismatch, atomic_write_json
    from dist_nce.cluster.fit import DoesNotFit, check_fits, service_request, workers_request
    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import configure_process, init_ray
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever
    from dist_nce.train.trainer import describe_plan, dev_table, fit, kb_snapshot, plan_for, unflatten, use_gpu

    configure_process(threads=None)
    # 2. data: the prepared KB (generated and prepared on first use), and what must fit its size
    try:
        ensure_prepared(cfg.data, cfg.model.retriever.mention_model)
        check_against_store(cfg, cfg.data.prepared_dir)
    except (ArtifactMismatch, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # 3. the service: S shards over the KB, index version 0 from the initial weights
    init_ray()
    try:  # shards and workers must fit the cluster together, or Ray Train waits, then times out
        check_fits([service_request(cfg.service), workers_request(cfg.run, use_gpu(cfg))], ray.cluster_resources())
    except DoesNotFit as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dist_nce.train.kb_control import KbWatcher

    service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    retriever = build_retriever(cfg.model, cfg.optim.seed)
    version = service.ensure_encoded(ray.put(retriever.entity_encoder_state()), version=0)
    del retriever
    plan = plan_for(cfg)
    print(f"run {cfg.run.name}:\n" + describe_plan(cfg, plan, service.ranges, version, use_gpu(cfg)), flush=True)
    # 4. train (resumes a run with the same name + storage_path); workers evaluate and export. Meanwhile a
    # KB delta asked for through <run.output_dir>/kb_update.json is served live (dist_nce/train/kb_control.py).
    with KbWatcher(service, cfg.run.output_dir, log=lambda m: print(m, flush=True)) as kb_watch:
        result = fit(cfg, service)
    final = unflatten(result.metrics or {})
    summary = {"config": to_dict(cfg), "plan": plan.as_dict(), "done": bool(final.get("done")),
               "step": final.get("step"), "dev_before": final.get("dev_before"),
               "dev_after": final.get("dev_after"), "index_version": final.get("index_version"),
               "export": final.get("export"), "seconds": round(time.perf_counter() - start, 1),
               "engine": final.get("engine"),  # device, DeepSpeed accelerator, ZeRO stage, bf16
               "kb_version": service.kb_version, "kb_updates": kb_watch.outcomes,
               # The path may be inside Ray's temporary copy of the working directory: keep the content.
               "deepspeed_config": json.loads(Path(cfg.deepspeed.config).read_text(encoding="utf-8"))}
    # 5. export: where the final KB embeddings live (the shards persisted them)
    if summary["done"] and cfg.run.export:
        summary["kb_snapshot"] = kb_snapshot(service, cfg, Path(cfg.run.output_dir) / "kb_snapshot")
    atomic_write_json(Path(cfg.run.output_dir) / "summary.json", summary)
    print(dev_table(summary["dev_before"], summary["dev_after"]))
    state = "finished" if summary["done"] else f"stopped at step {summary['step']} (run again to continue)"
    print(f"{state} in {summary['seconds']} s; summary: {Path(cfg.run.output_dir) / 'summary.json'}", flush=True)
    service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
