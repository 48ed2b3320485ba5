"""Run a grid of Zeshel retrievers (architectures x negatives) and tabulate it like the paper's Table 1.

The mini-paper on this CPU (synthetic Zeshel, tiny model, dual / multi-8 / SOM x random /
hard / mixed-50)::

    .venv/bin/python jobs/zeshel_grid.py --config configs/zeshel/retriever_tiny_cpu.yaml \\
        --rows configs/zeshel/grid_tiny_rows.yaml --out runs/zeshel_grid_tiny

The paper's Table 1 on a GPU cluster (or --only som_hard,som_mixed50 for some rows)::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/zeshel_grid.py \\
        --config configs/zeshel/retriever_paper_gpu.yaml --rows configs/zeshel/table1_rows.yaml \\
        --out /mnt/shared/runs/zeshel_grid --set data.zeshel_root=/mnt/shared/zeshel

The job is dist_nce/cli/zeshel_grid.py (also ``python -m dist_nce.cli.zeshel_grid`` and
``dist-nce-zeshel-grid``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.zeshel_grid import main

if __name__ == "__main__":
    raise SystemExit(main())
