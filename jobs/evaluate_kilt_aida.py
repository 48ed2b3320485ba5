"""Evaluate a retriever on KILT AIDA: top-k over ALL entities of a prepared KB, KILT guess files, KILT scores.

    .venv/bin/python jobs/evaluate_kilt_aida.py --model runs/aida/retriever \\
        --store data/prepared/kilt --out runs/aida/eval

    ray start --head --disable-usage-stats          # once; then, from the repository root:
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/evaluate_kilt_aida.py --model $PWD/runs/aida/retriever \\
        --store $PWD/data/prepared/kilt --out $PWD/runs/aida/eval --set num_shards=8

(``ray job submit`` runs the job in a copy of the working directory: give absolute paths.)

The job is dist_nce/cli/evaluate_kilt_aida.py (also ``python -m dist_nce.cli.evaluate_kilt_aida``
and ``dist-nce-evaluate-kilt-aida``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.evaluate_kilt_aida import main

if __name__ == "__main__":
    raise SystemExit(main())
