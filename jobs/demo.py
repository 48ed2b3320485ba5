"""The README's main job on its embedded default, run the way a cluster user runs it.

    make demo                                   # creates .venv, installs, runs this
    .venv/bin/python jobs/demo.py [--config configs/aida/tiny_cpu.yaml] [--set key=value ...]

1. ``ray start --head`` on loopback (dashboard 127.0.0.1, token auth kept on);
2. ``ray job submit --working-dir . -- python jobs/aida_finetune.py --config <config>``:
   synthetic KILT KB + AIDA files -> prepared store -> sharded NegativeService -> Ray Train
   + DeepSpeed finetuning with hard negatives -> dev evaluation before and after -> export;
3. the dev summary (before vs after) from ``<output_dir>/summary.json``;
4. the head is stopped (only this cluster: ``ray stop`` would end every Ray on the machine).

Data, checkpoints and exports go to absolute paths under this checkout (``data/``,
``runs/``; git-ignored), so they survive the job's temporary copy of the working dir.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dist_nce.runtime import free_port, ray_env  # noqa: E402


def _ray(bin_dir: Path, *args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(bin_dir / "ray"), *args]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, check=check)


def _start_head(bin_dir: Path, port: int, dash: int, env: dict[str, str]) -> subprocess.Popen:
    """``ray start --head --block`` in its own process group, so that stopping it ends
    exactly this cluster (``ray stop`` would end every Ray on the machine)."""
    cmd = [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dash}",
           "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"]
    print("$ " + " ".join(cmd), flush=True)
    head = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start --head exited with code {head.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=2):
                return head
        except urllib.error.HTTPError:  # it answers (401 without the token): it is up
            return head
        except OSError:
            time.sleep(1)
    _stop_head(head)
    raise RuntimeError("the Ray head's dashboard did not come up within 180 s")


def _stop_head(head: subprocess.Popen) -> None:
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/aida/tiny_cpu.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", default="demo", help="run name: runs/<name>, data/<name>")
    args = ap.parse_args(argv)

    bin_dir = Path(sys.executable).parent
    runs, data = ROOT / "runs", ROOT / "data"
    out = runs / args.name
    # The job's `python` must be this environment's, and its Ray client needs the token.
    env = ray_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "token",
                   "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    port, dash = free_port(), free_port()
    overrides = [
        f"data.prepared_dir={data / args.name / 'prepared'}",
        f"data.synthetic_dir={data / args.name / 'synthetic'}",
        f"run.output_dir={out}",
        f"run.storage_path={runs / 'ray_results'}",
        f"run.name={args.name}",
        *args.set,
    ]
    t0 = time.perf_counter()
    head = _start_head(bin_dir, port, dash, env)
    try:
        submit = ["job", "submit", f"--address=http://127.0.0.1:{dash}", "--working-dir", ".", "--",
                  "python", "jobs/aida_finetune.py", "--config", args.config]
        for o in overrides:
            submit += ["--set", o]
        rc = _ray(bin_dir, *submit, env=env, check=False).returncode
    finally:
        _stop_head(head)
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
