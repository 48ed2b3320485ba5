"""The paper's gradient-bias experiment (Zhang & Stratos 2021, section 5.5), on one CPU core.

A population over 1000 labels with small entropy; a feed-forward network with one ReLU
layer trained on cross-entropy with 128 iid labels per update. Before the first and after
every update it measures the exact CE and, by Monte Carlo over 10 draws of 4 negatives
(K=5), the NCE losses and the bias b(θ) = ∇J_CE - E[∇J_NCE] of Theorem 1 for hard,
random and mixed-50 negatives (dist_nce/bias/estimator.py). Writes to --out:

    bias.json      config, population entropy, one record per update (losses, ||b̂||,
                   Monte Carlo standard error, debiased ||b||, TV(p_θ, γ̂) per scheme)
    bias.png       left: CE / NCE losses vs updates; right: ||b̂|| per scheme, dotted =
                   the Monte Carlo noise floor (||b̂|| near it is not distinguishable from 0)
    manifest.json

Run from the repository root with the package installed (`make venv`); about 10 s with the
defaults (the authors' settings) on an idle core:

    .venv/bin/python jobs/bias_experiment.py --out runs/bias
    .venv/bin/python jobs/bias_experiment.py --out runs/bias --updates 100 --set num_draws=50
    .venv/bin/python jobs/bias_experiment.py --out runs/bias --config configs/bias/synthetic.yaml \\
        --set schemes='[hard, random, iid_model]' --set adjusted=true

Every field of ``dist_nce.bias.synthetic.SyntheticConfig`` can be set with --set key=value.
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

from dist_nce.bias.synthetic import SyntheticConfig, run_synthetic
from dist_nce.cli.common import error
from dist_nce.cluster.runtime import configure_threads
from dist_nce.core.artifacts import atomic_write_bytes, atomic_write_json, file_sha256, write_manifest
from dist_nce.core.config import (AT_LEAST_0, AT_LEAST_1, ConfigError, describe, from_dict, load_config,
                                  parse_overrides, to_dict)
from dist_nce.core.flags import FlagParser, existing, number, refuse

SCHEMA_VERSION = 1
COLORS = {"hard": "tab:red", "random": "tab:blue", "mixed": "tab:purple", "iid_model": "tab:orange"}


def plot(result: dict) -> bytes:
    """The two-panel figure as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    x = [r["update"] for r in recs]
    names = list(recs[0]["schemes"])
    fig, (ax_loss, ax_bias) = plt.subplots(1, 2, figsize=(13.5, 4.4), gridspec_kw={"width_ratios": [1, 1]})
    ax_loss.plot(x, [r["loss_ce"] for r in recs], "g:", lw=2.5, label="cross entropy (exact)")
    ax_loss.axhline(result["population_entropy"], color="k", ls="--", lw=1, label="entropy of pop")
    for name in names:
        color = COLORS.get(name.split("+")[0].rstrip("0123456789"), None)
        loss = [r["schemes"][name]["loss_nce"] for r in recs]
        se = [r["schemes"][name]["loss_nce_se"] for r in recs]
        ax_loss.plot(x, loss, color=color, lw=2, label=f"{name} NCE")
        ax_loss.fill_between(x, [a - 2 * b for a, b in zip(loss, se)], [a + 2 * b for a, b in zip(loss, se)],
                             color=color, alpha=0.2, lw=0)
        bias = [r["schemes"][name]["bias_norm"] for r in recs]
        floor = [r["schemes"][name]["mc_se"] for r in recs]
        ax_bias.plot(x, bias, color=color, lw=2, label=f"{name}: ||b̂||")
        ax_bias.plot(x, floor, color=color, lw=1, ls=":", label=f"{name}: MC noise floor")
    ax_bias.plot(x, [r["grad_ce_norm"] for r in recs], color="0.5", lw=1, ls="--",
                 label="||∇J_CE|| (bias of a zero gradient)")
    cfg = result["config"]
    ax_loss.set(xlabel="update", ylabel="loss (nats)", title=f"losses (K={cfg['num_negatives'] + 1})")
    ax_bias.set(xlabel="update", ylabel="||∇J_CE − E ∇J_NCE||",
                title=f"gradient bias, {cfg['num_draws']} Monte Carlo draws")
    ax_loss.set_ylim(bottom=0)
    ax_bias.set_ylim(bottom=0)
    ax_loss.legend(fontsize=8)
    ax_bias.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    for ax in (ax_loss, ax_bias):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{cfg['num_labels']} labels, H(pop) = {result['population_entropy']:.2f} nats, "
                 f"MLP with one ReLU layer ({result['num_params']:,} parameters)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = FlagParser(description=__doc__.split("\n")[0], epilog="config fields:\n" + describe(SyntheticConfig),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (bias.json, bias.png, manifest.json)")
    ap.add_argument("--config", type=existing("file", "config file"),
                    help="YAML with SyntheticConfig fields (default: the paper's settings)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--updates", type=number(int, AT_LEAST_0), help="shorthand for --set updates=N")
    ap.add_argument("--threads", type=number(int, AT_LEAST_1), default=1, help="torch intra-op threads [%(default)s]")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    ap.add_help_config(SyntheticConfig)
    args = ap.parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():  # written only after the experiment ran
        return refuse("--out", args.out, "not a directory")
    overrides = args.set + ([f"updates={args.updates}"] if args.updates is not None else [])
    try:
        if args.config:
            cfg = load_config(SyntheticConfig, args.config, overrides)
        else:
            cfg = from_dict(SyntheticConfig, parse_overrides(overrides), source="--set")
    except ConfigError as e:
        return error(e)
    configure_threads(args.threads)
    out = Path(args.out)
    print(f"synthetic bias experiment: {cfg.num_labels} labels, {cfg.updates} updates of {cfg.batch_size} labels, "
          f"K={cfg.num_negatives + 1}, {cfg.num_draws} draws, schemes {cfg.schemes}", flush=True)
    start = time.perf_counter()
    result = run_synthetic(cfg, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "bias.json", result)
    atomic_write_bytes(out / "bias.png", plot(result))
    write_manifest(out, "bias_experiment", SCHEMA_VERSION, config=to_dict(cfg), seconds=round(elapsed, 2),
                   files={name: file_sha256(out / name) for name in ("bias.json", "bias.png")})
    last = result["records"][-1]
    print(f"done in {elapsed:.1f}s; after {last['update']} updates: CE {last['loss_ce']:.3f} "
          f"(entropy {result['population_entropy']:.3f})")
    for name, est in last["schemes"].items():
        print(f"  {name:>20}: NCE {est['loss_nce']:.3f}  ||b̂|| {est['bias_norm']:.4f}  "
              f"MC s.e. {est['mc_se']:.4f}  debiased {est['bias_norm_debiased']:.4f}")
    print(f"wrote {out}/bias.json, bias.png, manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
