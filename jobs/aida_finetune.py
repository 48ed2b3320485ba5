"""Finetune an entity-linking retriever on AIDA (KILT) with hard-negative NCE.

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

The job is dist_nce/cli/aida_finetune.py (also ``python -m dist_nce.cli.aida_finetune`` and
``dist-nce-aida-finetune``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.aida_finetune import main

if __name__ == "__main__":
    raise SystemExit(main())
