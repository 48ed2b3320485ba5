"""A driver that started a local Ray (dist_nce.cluster.runtime.init_ray) leaves no process behind when
it is SIGKILLed; Ray alone leaves its two raylet agents running for a minute (dist_nce/cluster/reaper.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dist_nce.cluster.reaper import cluster_processes

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]

DRIVER = r"""
import sys, time
import ray
from dist_nce.cluster.runtime import init_ray

ctx = init_ray(num_cpus=1)

@ray.remote
class Idle:
    def pid(self):
        import os
        return os.getpid()

actor = Idle.remote()
print("ready", ctx.address_info["session_dir"], ray.get(actor.pid.remote()), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def in_session(sid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and session_of(int(p.name)) == sid]


def start_driver(mode: str, tmp: str) -> tuple[subprocess.Popen, str, int]:
    env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", DRIVER, mode], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = p.stdout.readline()  # blocks until the cluster and the actor are up
    assert line.startswith("ready "), f"driver did not start: {line!r} (exit {p.poll()})"
    _, session_dir, actor_pid = line.split()
    return p, session_dir, int(actor_pid)


def wait_until_empty(find, timeout: float) -> tuple[list[int], float]:
    start = time.monotonic()
    while (left := find()) and time.monotonic() - start < timeout:
        time.sleep(0.25)
    return left, time.monotonic() - start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")
def test_a_sigkilled_driver_leaves_no_ray_process():
    with tempfile.TemporaryDirectory(prefix="reap_", dir="/tmp") as tmp:  # short: Ray's socket paths
        p, session_dir, actor_pid = start_driver("wait", tmp)
        try:
            members = set(in_session(p.pid))
            titles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in members
                      if Path(f"/proc/{pid}/cmdline").exists()}
            # what Ray alone would leave running for 60 s, and the reaper that ends it
            for agent in (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent"):
                assert agent in titles.values(), sorted(titles.values())
            assert actor_pid in members and set(cluster_processes(session_dir)) >= {actor_pid}
            reapers = [pid for pid, t in titles.items() if b"dist_nce/cluster/reaper.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(reapers) == 1, titles
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        left, took = wait_until_empty(lambda: in_session(p.pid) + cluster_processes(session_dir), timeout=20)
        survivors = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in left
                     if Path(f"/proc/{pid}/cmdline").exists()}
        assert not left, f"still running {took:.0f} s after the driver was killed: {survivors}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")
def test_a_driver_that_exits_normally_leaves_no_reaper():
    with tempfile.TemporaryDirectory(prefix="reap_", dir="/tmp") as tmp:
        p, session_dir, _ = start_driver("exit", tmp)
        assert p.wait(timeout=120) == 0
        left, took = wait_until_empty(lambda: in_session(p.pid) + cluster_processes(session_dir), timeout=20)
        assert not left, f"still running {took:.0f} s after the driver exited: {left}"
