"""The README's main job on its embedded default, run the way a cluster user runs it.

    make demo                                   # creates .venv, installs, runs this
    .venv/bin/python jobs/demo.py [--config configs/aida/tiny_cpu.yaml] [--set key=value ...]

The job is dist_nce/cli/demo.py (also ``python -m dist_nce.cli.demo`` and ``dist-nce-demo``,
from the checkout); ``--help`` and its docstring say more.
"""
from dist_nce.cli.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
