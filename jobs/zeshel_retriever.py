"""Train a Zeshel retriever (dual, poly-m, multi-m, SOM) with random, hard or mixed-p negatives.

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
The job is dist_nce/cli/zeshel_retriever.py (also ``python -m dist_nce.cli.zeshel_retriever``
and ``dist-nce-zeshel-retriever``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.zeshel_retriever import main

if __name__ == "__main__":
    raise SystemExit(main())
