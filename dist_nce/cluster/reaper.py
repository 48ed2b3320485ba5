"""End what is left of a local Ray cluster when the driver that started it dies, however it dies.

``ray.init()`` without an address (:func:`dist_nce.cluster.runtime.init_ray` outside ``ray job
submit``) starts a cluster whose processes share the driver's fate through the kernel
(Linux ``PR_SET_PDEATHSIG``): GCS, raylet and dashboard die with the driver, and the
workers and actors (``ray::EntityShard``, ``ray::RayTrainWorker``, ...) exit within seconds
when their raylet is gone. Two processes do not (Ray 2.60): the raylet's ``ray::DashboardAgent``
and ``ray::RuntimeEnvAgent`` see the raylet die at once, but before exiting they publish
"raylet died unexpectedly" to the GCS, which died with it, and that call waits out a fixed
60 s timeout (``ray/_private/process_watcher.py``; ``publish_error_to_driver``). A driver
killed with SIGKILL (or by the OOM killer) so leaves ~350 MB of agents behind for a minute,
and a loop that restarts a killed job stacks them up.

:func:`reap_when_driver_dies` starts one small process per local cluster (stdlib only, no
Ray import) that blocks reading a pipe whose write end only the driver holds. The kernel
closes the pipe when the driver exits, normally or not; the reaper then SIGKILLs the
processes still running that belong to THIS cluster, and exits:

* a process whose command line names the cluster's session directory (GCS, raylet,
  dashboard, log monitor), or
* a ``ray::``/``ray-dashboard-`` process (Ray rewrites its workers' and agents' titles)
  holding a file open inside that session directory (each holds its own log files there).

Nothing else is touched: other Ray clusters on the machine have other session directories.
A driver that exits normally has already stopped its cluster (``ray.shutdown`` at exit), so
the reaper then finds nothing. The reaper ignores SIGINT, SIGTERM and SIGHUP: a Ctrl-C or a
``kill`` of the whole process group ends the driver, and the reaper still cleans up after it.
Linux only (it reads ``/proc``); elsewhere nothing is started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_TITLES = (b"ray::", b"ray-dashboard-")
_reapers: list[subprocess.Popen] = []  # the write ends of their pipes live as long as this process


def reap_when_driver_dies(session_dir: str) -> subprocess.Popen | None:
    """Start the reaper of the local cluster whose session directory is ``session_dir``
    (``ray.init(...).address_info["session_dir"]``); returns it (None where unsupported)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    # -I -S: isolated, no site import (stdlib only, starts in milliseconds). The pipe's write end is not
    # inheritable, so no process started later holds it open after the driver is gone.
    proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), os.path.abspath(session_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
    _reapers.append(proc)
    return proc


def cluster_processes(session_dir: str, exclude: int | None = None) -> list[int]:
    """Pids of the running processes that belong to the Ray cluster of ``session_dir``."""
    session = os.path.abspath(session_dir).encode()
    inside = session + b"/"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # exited meanwhile
            continue
        if session in cmd or (cmd.startswith(_TITLES) and _holds_file_in(entry.name, inside)):
            found.append(int(entry.name))
    return found


def _holds_file_in(pid: str, prefix: bytes) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(os.fsencode(f"/proc/{pid}/fd/{fd}")).startswith(prefix):
                return True
        except OSError:
            continue
    return False


def _main(session_dir: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):  # returns b"" once the driver is gone
        pass
    for _ in range(10):  # a process may appear while we kill (a worker the raylet was starting)
        left = cluster_processes(session_dir, exclude=os.getpid())
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


if __name__ == "__main__":
    _main(sys.argv[1])
