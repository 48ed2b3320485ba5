"""kb.parent_watch: a process ends soon after its parent dies, by either mechanism."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The child starts a grandchild bound to it, prints the grandchild's pid, then waits to be killed.
CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    print(grandchild.pid, flush=True)
    time.sleep(120)
""")
GRANDCHILD = textwrap.dedent("""
    import sys, time
    import kb.parent_watch as w
    if {no_prctl}:
        w._set_parent_death_signal = lambda sig: False  # only the portable watchdog is left
    w.exit_with_parent(int(sys.argv[1]), poll=0.1)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an unreaped zombie no longer runs or holds memory


@pytest.mark.parametrize("no_prctl", [False, True], ids=["prctl", "watchdog"])
def test_process_ends_when_its_parent_is_killed(no_prctl):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, GRANDCHILD.format(no_prctl=no_prctl)], env=env,
                             stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        time.sleep(1.0)  # past the start-up checks, into the steady state
        assert _alive(grandchild), "the grandchild ended while its parent was alive"
        child.kill()
        child.wait()
        deadline = time.time() + 5
        while _alive(grandchild) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the grandchild outlived its parent by 5 s"
    finally:
        if child.poll() is None:
            child.kill()
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
