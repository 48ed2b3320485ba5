"""The paper's gradient-bias experiment (Zhang & Stratos 2021, section 5.5), on one CPU core.

Run from the repository root with the package installed (`make venv`); about 10 s with the
defaults (the authors' settings) on an idle core:

    .venv/bin/python jobs/bias_experiment.py --out runs/bias
    .venv/bin/python jobs/bias_experiment.py --out runs/bias --updates 100 --set num_draws=50
    .venv/bin/python jobs/bias_experiment.py --out runs/bias --config configs/bias/synthetic.yaml \\
        --set schemes='[hard, random, iid_model]' --set adjusted=true

The job is dist_nce/cli/bias_experiment.py (also ``python -m dist_nce.cli.bias_experiment`` and
``dist-nce-bias-experiment``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.bias_experiment import main

if __name__ == "__main__":
    raise SystemExit(main())
