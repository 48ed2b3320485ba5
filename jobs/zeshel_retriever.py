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

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout (also under ray job submit)

from dist_nce.core.config import ConfigError, describe, load_config  # noqa: E402
from dist_nce.core.models import ensure_tiny_models  # noqa: E402
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute, check_zeshel_inputs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="experiment YAML (configs/zeshel/retriever_*.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no evaluation progress bars")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the config and every input path, then exit (no data generation, no Ray)")
    ap.add_argument("--help-config", action="store_true", help="print every config field and exit")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe(ZeshelRetrieverConfig))
        return 0
    if not args.config:
        ap.error("--config is required")
    try:  # every key and input path checked before any data or cluster work
        cfg = absolute(load_config(ZeshelRetrieverConfig, args.config, args.set))
        # A config naming the project's tiny-model path (data/models/tiny_bert) runs from a fresh
        # clone: the random tiny BERT is built there on first use, before the input checks.
        ensure_tiny_models({"model.retriever.mention_model": cfg.model.retriever.mention_model,
                            "model.retriever.entity_model": cfg.model.retriever.entity_model})
        check_zeshel_inputs(cfg)
    except (ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"{args.config}: config and inputs OK (dry run: nothing generated, no Ray started)")
        return 0

    from dist_nce.core.artifacts import ArtifactMismatch
    from dist_nce.cluster.runtime import configure_process
    from dist_nce.zeshel.data import ensure_zeshel_stores
    from dist_nce.zeshel.run import SUMMARY, run_retriever
    from kb.prepare import PrepareError

    configure_process(threads=None)
    log = lambda s: print(s, flush=True)  # noqa: E731
    try:  # data first: a stale or mismatched directory is a message, not a traceback
        ensure_zeshel_stores(cfg, log)
    except (ArtifactMismatch, PrepareError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # what the store's size or the cluster's resources cannot hold is refused before any encoding
        summary = run_retriever(cfg, progress=args.progress, log=log)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = "finished" if summary["done"] else f"stopped at step {summary['step']} (run again to continue)"
    print(f"{state} in {summary['seconds']} s; summary: {Path(cfg.run.output_dir) / SUMMARY}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
