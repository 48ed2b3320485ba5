"""``ray job submit`` to a :class:`~dist_nce.cluster.head.LocalHead`, the way a cluster user runs a job.

:func:`submit_and_follow` submits an entrypoint with ``--working-dir .`` (retried while a fresh
head's job agent is still starting), follows its log, and reads the final ``ray job status``.
``make demo`` (dist_nce/cli/demo.py) and ``benchmarks/gpu_e2e.py`` submit their jobs through it.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

SUBMIT_ATTEMPTS = 30  # x 5 s: a fresh head's job agent can take a minute on a loaded machine


def _ray(bin_dir: Path, args: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike,
         stdout: IO[str] | None) -> int:
    cmd = [str(bin_dir / "ray"), *args]
    print("$ " + " ".join(cmd), flush=True, file=stdout)
    return subprocess.run(cmd, env=dict(env), cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                          check=False).returncode


def submit_and_follow(bin_dir: Path, address: str, entrypoint: Sequence[str], env: Mapping[str, str], *,
                      cwd: str | os.PathLike, job_id: str, log: IO[str] | None = None) -> int:
    """Submit ``entrypoint`` (e.g. ``["python", "jobs/aida_finetune.py", "--config", c]``) with the
    working directory ``cwd``, follow its log (to ``log``, else this process's stdout) and return 0
    if Ray reports it SUCCEEDED, else 1. ``env``: the head's client environment (LocalHead.env)."""
    addr = f"--address={address}"
    submit = ["job", "submit", addr, f"--submission-id={job_id}", "--no-wait", "--working-dir", ".", "--",
              *entrypoint]
    for _ in range(SUBMIT_ATTEMPTS):
        if _ray(bin_dir, submit, env, cwd, log) == 0:
            break
        print("the head's job agent is not up yet; retrying in 5 s", flush=True, file=log)
        time.sleep(5)
    else:
        return 1
    _ray(bin_dir, ["job", "logs", addr, "--follow", job_id], env, cwd, log)
    status = subprocess.run([str(bin_dir / "ray"), "job", "status", addr, job_id], env=dict(env), cwd=cwd,
                            capture_output=True, text=True)
    said = (status.stdout + status.stderr).strip()
    # Ray 2.60 prints "Job '<id>' succeeded" between separator lines (older: "...: SUCCEEDED").
    lines = [line for line in said.splitlines() if job_id in line]
    print(lines[-1] if lines else said or "ray job status printed nothing", flush=True, file=log)
    return 0 if any("succeeded" in line.lower() for line in lines) else 1
