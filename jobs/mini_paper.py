"""The paper's Tables 1 and 2 in miniature, over several seeds, with the live bias monitor: one resumable job.

    .venv/bin/python jobs/mini_paper.py --config configs/mini_paper/tiny_cpu.yaml --out runs/mini_paper
    .venv/bin/python jobs/mini_paper.py --config configs/mini_paper/tiny_cpu.yaml --out runs/mini_paper \\
        --set 'seeds=[7, 8, 9]'          # the same grid on seeds the project did not use
    .venv/bin/python jobs/mini_paper.py ... --only zeshel,aida   # parts (reranker needs zeshel)

The job is dist_nce/cli/mini_paper.py (also ``python -m dist_nce.cli.mini_paper`` and
``dist-nce-mini-paper``, from the checkout); ``--help`` and its docstring say more.
"""
from dist_nce.cli.mini_paper import main

if __name__ == "__main__":
    raise SystemExit(main())
