"""What an actor costs to start on a local Ray: the workers' settings in the node's environment
(what ``dist_nce.cluster.runtime.init_ray`` does) against the same settings as the job's runtime env.

A worker whose job (or actor) has a runtime env is started through Ray's ``setup_worker.py``: an
interpreter that imports part of Ray, then execs the real worker; a worker of a job without one
is started directly, and can be one of the idle workers the node prestarts. Each round starts a
fresh local Ray in a child process, per method:

* ``node_env``: ``init_ray`` (the settings go into the node's environment; no runtime env);
* ``runtime_env``: ``ray.init`` with the same settings as ``runtime_env={"env_vars": ...}``
  (what ``init_ray`` did before).

The child then creates ``--actors`` trivial actors (``num_cpus=0``), waits until each has answered
with its pid and the settings it sees (checked equal for both methods), and reports the seconds
from the first creation to the last answer and the CPU seconds (user + system) of the actors'
processes, ``setup_worker.py`` included (the exec keeps the pid). Rounds alternate the methods
(A B A B ...); stored per method as min / median / max, compared by :func:`common.compare`.

    .venv/bin/python -m benchmarks.ray_start                   # 5 rounds x 6 actors
    .venv/bin/python -m benchmarks.ray_start --rounds 1 --actors 2 --out /tmp/r.json --force
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

METHODS = ("node_env", "runtime_env")
REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


def child(method: str, actors: int) -> dict:
    """One local Ray started by ``method``, ``actors`` actors: their start seconds, CPU and settings."""
    import psutil
    import ray

    from dist_nce.cluster import runtime

    if method == "node_env":
        runtime.init_ray(num_cpus=2, include_dashboard=False)
    else:
        for k, v in runtime.RAY_LOCAL_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 runtime_env={"env_vars": runtime.ray_runtime_env_vars()})

    @ray.remote(num_cpus=0)
    class Probe:
        def report(self) -> tuple[int, dict]:
            return os.getpid(), {k: os.environ.get(k) for k in SETTINGS}

    try:
        t0 = time.perf_counter()
        handles = [Probe.remote() for _ in range(actors)]
        answers = ray.get([h.report.remote() for h in handles])
        seconds = time.perf_counter() - t0
        cpu = 0.0
        for pid, _ in answers:
            times = psutil.Process(pid).cpu_times()
            cpu += times.user + times.system
        settings = [s for _, s in answers]
        if any(s != settings[0] for s in settings):
            raise RuntimeError(f"{method}: the actors saw different settings: {settings}")
        return {"seconds": seconds, "cpu_s": cpu, "settings": settings[0],
                "job_runtime_env": dict(ray.get_runtime_context().runtime_env)}
    finally:
        ray.shutdown()


def one_round(method: str, actors: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.ray_start", "--child", method, "--actors", str(actors)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{method} round failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(rounds: int, actors: int) -> dict:
    """Alternating rounds; per method the spreads of start seconds and of CPU seconds per actor."""
    got: dict[str, list[dict]] = {m: [] for m in METHODS}
    for _ in range(rounds):
        for m in METHODS:
            got[m].append(one_round(m, actors))
    out: dict = {}
    for m in METHODS:
        out[m] = {"start_s": common.spread([r["seconds"] for r in got[m]]),
                  "cpu_s_per_actor": common.spread([r["cpu_s"] / actors for r in got[m]]),
                  "settings": got[m][0]["settings"], "job_runtime_env": got[m][0]["job_runtime_env"]}
    if out["node_env"]["settings"] != out["runtime_env"]["settings"]:
        raise RuntimeError(f"the methods' actors saw different settings: {out['node_env']['settings']} vs "
                           f"{out['runtime_env']['settings']}")
    out["compare"] = {k: common.compare(out["node_env"][k], out["runtime_env"][k])
                      for k in ("start_s", "cpu_s_per_actor")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--actors", type=int, default=6)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ray_start.json)")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    common.add_hygiene_args(ap)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.actors)), flush=True)
        return
    guard = common.load_guard(args.force)
    result = run(args.rounds, args.actors)
    payload = {"benchmark": "ray_start", **guard, "machine": common.machine_info(), "rounds": args.rounds,
               "actors": args.actors, "methods": result}
    common.print_table([{"method": m, "start": result[m]["start_s"]["median"],
                         "cpu": result[m]["cpu_s_per_actor"]["median"]} for m in METHODS],
                       [("method", "method", "<12s"), ("start", "start s (median)", ">16.2f"),
                        ("cpu", "CPU s per actor (median)", ">24.2f")])
    print("wrote", common.save_results("ray_start", payload, args.out))


if __name__ == "__main__":
    main()
