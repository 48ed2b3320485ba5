"""The README's main job on its embedded default, run the way a cluster user runs it.

    make demo                                   # creates .venv, installs, runs this
    .venv/bin/python jobs/demo.py [--config configs/aida/tiny_cpu.yaml] [--set key=value ...]

1. ``ray start --head`` on loopback (dashboard 127.0.0.1) with token authentication on: a
   machine that has never run Ray gets a token in ``~/.ray/auth_token`` first
   (:class:`dist_nce.cluster.head.LocalHead`);
2. ``ray job submit --working-dir . -- python jobs/aida_finetune.py --config <config>``:
   synthetic KILT KB + AIDA files -> prepared store -> sharded NegativeService -> Ray Train
   + DeepSpeed finetuning with hard negatives -> dev evaluation before and after -> export;
3. the dev summary (before vs after) from ``<output_dir>/summary.json``;
4. the head is stopped (only this cluster: ``ray stop`` would end every Ray on the machine;
   it also dies if this script is killed).

Data, checkpoints and exports go to absolute paths under this checkout (``data/``,
``runs/``; git-ignored), so they survive the job's temporary copy of the working dir. The
synthetic data and prepared store (``data/<name>/``) are reused while the config's
``data.*`` settings stay the same; every demo is a new run in ``runs/<name>/<time>/``
(Ray Train run ``<name>-<time>``), so running it again trains again instead of resuming
the finished run.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dist_nce.cli.common import CHECKOUT as ROOT, error
from dist_nce.core.config import ConfigError, load_config, plain_name
from dist_nce.core.flags import FlagParser, checked
from dist_nce.cluster.head import LocalHead
from dist_nce.cluster.submit import submit_and_follow


def _config_file(text: str) -> str:
    if not (ROOT / text).is_file():  # an absolute text replaces ROOT
        raise ValueError(f"not found (relative paths are read from {ROOT})")
    return text


def _plain(text: str) -> str:
    why = plain_name(text)
    if why:
        raise ValueError(why)
    return text


def main(argv: list[str] | None = None) -> int:
    from dist_nce.train.config import TrainJobConfig

    ap = FlagParser(description=__doc__.split("\n")[0])
    # The job runs in a copy of this checkout: a relative --config is read there.
    ap.add_argument("--config", type=checked(_config_file, "file"), default="configs/aida/tiny_cpu.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", type=checked(_plain, "name"), default="demo", help="run name: runs/<name>, data/<name>")
    ap.add_help_config(TrainJobConfig, "the AIDA job's, which the demo submits")
    args = ap.parse_args(argv)

    runs, data = ROOT / "runs", ROOT / "data"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = runs / args.name / stamp
    overrides = [
        f"data.prepared_dir={data / args.name / 'prepared'}",
        f"data.synthetic_dir={data / args.name / 'synthetic'}",
        f"run.output_dir={out}",
        f"run.storage_path={runs / 'ray_results'}",
        f"run.name={args.name}-{stamp}",
        *args.set,
    ]
    try:  # the job would refuse a bad --set only after the head started and the job was submitted
        load_config(TrainJobConfig, ROOT / args.config, overrides)
    except ConfigError as e:
        return error(e)
    t0 = time.perf_counter()
    # The job's `python` must be this environment's (LocalHead puts it first on PATH).
    head = LocalHead(num_cpus=2, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    print("$ " + " ".join(head.command()), flush=True)
    print(f"(token authentication on; token: {head.token_location})", flush=True)
    with head:
        entrypoint = ["python", "jobs/aida_finetune.py", "--config", args.config]
        for o in overrides:
            entrypoint += ["--set", o]
        rc = submit_and_follow(head.bin_dir, head.address, entrypoint, head.env, cwd=ROOT,
                               job_id=f"dist_nce_demo_{int(time.time())}")
    if rc != 0:
        print(f"demo: the job failed (exit {rc}); see the log above", file=sys.stderr)
        return rc
    from dist_nce.train.trainer import dev_table

    summary = json.loads((out / "summary.json").read_text())
    print(f"\n=== demo finished in {time.perf_counter() - t0:.0f} s ===")
    print(dev_table(summary["dev_before"], summary["dev_after"]))
    print(f"exports, TensorBoard logs and summary.json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
