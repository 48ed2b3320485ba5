"""Train a Zeshel retriever (dual, poly-m, multi-m, SOM) with random, hard or mixed-p negatives.

The same trainer and NegativeService as jobs/aida_finetune.py; the shards serve only the
TRAINING worlds' entities, so every negative is a train-world entity (as in the paper).
After training: top-64 recall on val and test, labelled ``own_world`` (each mention
among its own world's entities: the Zeshel protocol) and ``split_union`` (among all
entities of the split's worlds), macro over worlds and micro; and the reranker's
candidates files ``<run.output_dir>/candidates/candidates_{train,val,test}.json``
(``{"mention_id", "candidates": [document_id, ...]}`` per line, best first).

Without a cluster (starts a local Ray; synthetic data is generated on first use)::

    .venv/bin/python jobs/zeshel_retriever.py --config configs/zeshel/retriever_tiny_cpu.yaml
    .venv/bin/python jobs/zeshel_retriever.py --config configs/zeshel/retriever_tiny_cpu.yaml \\
        --set model.retriever.preset=som --set service.index.backend=torch --set negatives.mode=hard

On a Ray cluster, the paper's setting (BERT-base, 128 tokens, K = 64; one row of Table 1
per --set combination, or all of them with jobs/zeshel_grid.py)::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/zeshel_retriever.py \\
        --config configs/zeshel/retriever_paper_gpu.yaml --set data.zeshel_root=/mnt/shared/zeshel \\
        --set negatives.mode=mixed --set negatives.p=50

(with token authentication on, as the README sets a head up, prefix ``RAY_AUTH_MODE=token``).
Running the same command again resumes the run from its last checkpoint. Give absolute
paths under ``--working-dir .``. Every config field: ``--help-config``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from dist_nce.cli.common import ConfigJob, error, hold_run, interrupted, interrupted_preparing, retriever_models
from dist_nce.core.config import ConfigError
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute, check_zeshel_inputs


def _check_existing_store(cfg: ZeshelRetrieverConfig) -> None:
    from dist_nce.train.trainer import check_existing_store
    from dist_nce.zeshel.config import training_config
    from dist_nce.zeshel.data import store_conflicts

    problems = store_conflicts(cfg)  # a store the run would refuse to prepare over
    if problems:
        raise ConfigError("\n".join(problems))

    check_existing_store(training_config(cfg))  # the training store (data.prepared_dir)


JOB = ConfigJob(ZeshelRetrieverConfig, "experiment YAML (configs/zeshel/retriever_*.yaml)", absolute,
                lambda cfg: retriever_models(cfg.model), check_zeshel_inputs, _check_existing_store)


def main(argv: list[str] | None = None) -> int:
    ap = JOB.parser(__doc__, progress="no evaluation progress bars")
    args = ap.parse_args(argv)
    cfg = JOB.start(ap, args)  # every key and input path checked before any data or cluster work
    if isinstance(cfg, int):
        return cfg
    held = hold_run(cfg.run)  # one live job per run directory: a second one stops here (status 2)
    if isinstance(held, int):
        return held
    with held:
        return train(cfg, args.progress)


def train(cfg: ZeshelRetrieverConfig, progress: bool) -> int:
    """The job after its checks, on a run this process holds: data, then the run."""
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.core.artifacts import ArtifactMismatch
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.run import SUMMARY, run_retriever
    from kb.prepare import PrepareError

    configure_process(threads=None)
    log = lambda s: print(s, flush=True)  # noqa: E731
    try:  # data first: a stale or mismatched directory is a message, not a traceback
        ensure_zeshel_stores(cfg, log)
    except (ArtifactMismatch, PrepareError, FileNotFoundError, ValueError) as e:
        return error(e)
    except KeyboardInterrupt:
        return interrupted_preparing(f"{cfg.data.prepared_dir}, {cfg.zeshel.eval_store}")
    try:  # what the store's size or the cluster's resources cannot hold is refused before any encoding
        summary = run_retriever(cfg, progress=progress, log=log)
    except ConfigError as e:
        return error(e)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train aborted the run (the shards are shut down)
        return interrupted(cfg.run)
    state = "finished" if summary["done"] else f"stopped at step {summary['step']} (run again to continue)"
    print(f"{state} in {summary['seconds']} s; summary: {Path(cfg.run.output_dir) / SUMMARY}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
