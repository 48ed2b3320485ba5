"""Train the joint cross-encoder reranker on a retriever's top-64 Zeshel candidates, then evaluate it.

Candidates come from jobs/zeshel_retriever.py (``data.candidates_dir`` = its
``candidates/``) or from Zeshel's own TF-IDF lists::

    .venv/bin/python jobs/zeshel_reranker.py --config configs/zeshel/reranker_tiny_cpu.yaml
    .venv/bin/python jobs/zeshel_reranker.py --config configs/zeshel/reranker_paper_gpu.yaml \\
        --set data.candidates_dir=/data/zeshel/tfidf_candidates --set data.candidates_format=tfidf

On a Ray cluster::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/zeshel_reranker.py \\
        --config configs/zeshel/reranker_paper_gpu.yaml \\
        --set data.candidates_dir=/mnt/shared/runs/zeshel_som_mixed50/candidates

The job is dist_nce/cli/zeshel_reranker.py (also ``python -m dist_nce.cli.zeshel_reranker`` and
``dist-nce-zeshel-reranker``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.zeshel_reranker import main

if __name__ == "__main__":
    raise SystemExit(main())
