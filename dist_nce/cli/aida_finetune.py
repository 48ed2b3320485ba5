"""Finetune an entity-linking retriever on AIDA (KILT) with hard-negative NCE.

Prepares the KB (synthetic data when configured), starts the sharded NegativeService and
encodes index version 0, trains with Ray Train + DeepSpeed (dist_nce/train/), evaluates
on dev before and after, exports the model (Hugging Face + BLINK layout) and the KB
snapshot, and writes ``<run.output_dir>/summary.json``.

On a Ray cluster (here: a head started with ``ray start --head`` with token authentication
on: docs/cluster.md; the client needs ``RAY_AUTH_MODE=token`` and the token)::

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

import sys
import time
from pathlib import Path

from dist_nce.cli.common import ConfigJob, error, hold_run, interrupted, interrupted_preparing, retriever_models
from dist_nce.core.config import to_dict
from dist_nce.train.config import TrainJobConfig, check_inputs, with_absolute_paths


def _check_existing_store(cfg: TrainJobConfig) -> None:
    from dist_nce.core.config import ConfigError
    from dist_nce.train.data import store_conflict
    from dist_nce.train.trainer import check_existing_store

    # the store this job prepares (the Zeshel job prepares its own: zeshel.data.store_conflicts)
    problem = store_conflict(cfg.data, cfg.model.retriever.mention_model)
    if problem:
        raise ConfigError(problem)
    check_existing_store(cfg)


def _check(cfg: TrainJobConfig) -> None:
    from dist_nce.train.model import check_blink_init

    check_inputs(cfg)
    check_blink_init(cfg.model, cfg.optim.seed)  # loads the checkpoint: after the cheap checks passed


JOB = ConfigJob(TrainJobConfig, "experiment YAML (configs/aida/*.yaml)", with_absolute_paths,
                lambda cfg: retriever_models(cfg.model), _check, _check_existing_store)


def main(argv: list[str] | None = None) -> int:
    ap = JOB.parser(__doc__)
    # 1. config: every key and every input path checked before any cluster work
    cfg = JOB.start(ap, ap.parse_args(argv))
    if isinstance(cfg, int):
        return cfg
    # 2. the run: one live job per run directory (a second one stops here, status 2), held to the end
    held = hold_run(cfg.run)
    if isinstance(held, int):
        return held
    with held:
        return train(cfg)


def train(cfg: TrainJobConfig) -> int:
    """Steps 3 to 5 of the job, on a checked config whose run this process holds."""
    start = time.perf_counter()

    from dist_nce.cluster.fit import DoesNotFit
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.core.artifacts import ArtifactMismatch, atomic_write_json
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.driver import run_training
    from dist_nce.train.trainer import check_prepared, dev_table
    from dist_nce.worker.tracking import finish_tracking

    configure_process(threads=None)
    # 3. data: the prepared KB (generated and prepared on first use), and what must fit its size
    try:
        ensure_prepared(cfg.data, cfg.model.retriever.mention_model)
        # K and shards within the KB, and a rerun over a changed KB or plan: refused here, not by every
        # restarted worker after the shards encoded the KB
        check_prepared(cfg, cfg.data.prepared_dir)
    except (ArtifactMismatch, FileNotFoundError, ValueError) as e:
        return error(e)
    except KeyboardInterrupt:
        return interrupted_preparing(cfg.data.prepared_dir)
    # 4. the service (S shards over the KB, index version 0 from the initial weights), then training:
    # workers evaluate and export. Meanwhile a KB delta asked for through <run.output_dir>/kb_update.json
    # is served live (dist_nce/train/kb_control.py).
    try:
        summary = run_training(cfg, cfg.data.prepared_dir, config=to_dict(cfg), started=start, watch_kb=True,
                               heading=lambda _: f"run {cfg.run.name}:", log=lambda m: print(m, flush=True))
    except DoesNotFit as e:
        return error(e)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train aborted the run (the shards are shut down)
        return interrupted(cfg.run)
    atomic_write_json(Path(cfg.run.output_dir) / "summary.json", summary)
    # 5. run.tracking: the dev scores and the model into the run the workers opened
    finish_tracking(cfg.run.tracking, cfg.run.output_dir, cfg.run.name, summary,
                    (summary.get("export") or {}).get("model"), lambda m: print(m, flush=True))
    print(dev_table(summary["dev_before"], summary["dev_after"]))
    state = "finished" if summary["done"] else f"stopped at step {summary['step']} (run again to continue)"
    print(f"{state} in {summary['seconds']} s; summary: {Path(cfg.run.output_dir) / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
