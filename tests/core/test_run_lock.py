"""One live job per run directory (dist_nce.core.run_lock): a second process is refused with the holder named,
a killed holder leaves no lock behind, and neither a forked nor an exec'd child of the holder keeps it."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_nce.core.run_lock import LOCK_FILE, LockUnsupported, RunDirBusy, acquire

REPO = Path(__file__).resolve().parents[2]

# Takes the lock of argv[1], starts the children argv[2] asks for, prints their pids, then waits to be killed.
HOLDER = r"""
import json, multiprocessing, subprocess, sys, time
from dist_nce.core.run_lock import acquire

lock = acquire(sys.argv[1])
children = []
if "fork" in sys.argv[2]:  # a multiprocessing child made by fork(), no exec: it shares the lock's file description
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    p.start()
    children.append(p.pid)
if "exec" in sys.argv[2]:  # a program the holder starts, every inheritable descriptor left open to it
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], close_fds=False).pid)
print(json.dumps(children), flush=True)
time.sleep(600)
"""


def start_holder(directory: Path, children: str = "") -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), children], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the holder exited ({proc.wait()}) before taking the lock"
    return proc, json.loads(line)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_second_process_is_refused_with_the_holder_named_and_a_killed_holder_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "runs" / "x"  # made by the holder's acquire
    holder, _ = start_holder(run_dir)
    try:
        with pytest.raises(RunDirBusy) as refused:
            acquire(run_dir)
        said = str(refused.value)
        assert said.startswith(f"{run_dir} is in use by another job (pid {holder.pid} on host {socket.gethostname()}, "
                               "since "), said
        assert said.endswith(f"; lock {run_dir / LOCK_FILE}): wait for it to end, stop it, or use another run "
                             "directory"), said
        assert "\n" not in said
        assert refused.value.holder["pid"] == holder.pid
        with pytest.raises(RunDirBusy, match=r"^Ray Train run r is in use .* or use another run\.name$"):
            acquire(run_dir, what="Ray Train run r", instead="use another run.name")
    finally:
        holder.kill()  # SIGKILL: no handler, no cleanup in the holder
        holder.wait()
    with acquire(run_dir) as lock:  # no stale lock: the kernel dropped it with the process
        assert lock.held
        record = json.loads((run_dir / LOCK_FILE).read_text())
        assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())  # the dead one's replaced


def test_the_same_process_takes_it_again_after_a_release(tmp_path):
    lock = acquire(tmp_path)
    with pytest.raises(RunDirBusy):  # a second lock of this process's own: refused too
        acquire(tmp_path)
    lock.release()
    assert not lock.held
    lock.release()  # again: nothing
    with acquire(tmp_path) as again:
        assert again.held
        lock.release()  # the old lock's descriptor number may be the new one's: it is not closed for it
        assert again.held
        with pytest.raises(RunDirBusy):
            acquire(tmp_path)
    assert not again.held
    acquire(tmp_path).release()


def test_a_file_left_by_a_dead_job_is_no_lock(tmp_path):
    """The record only names a holder; the lock is the flock. A crashed job's file is simply taken again."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "since": "long ago"}))
    with acquire(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("children", ["fork", "exec"])
def test_children_of_a_killed_holder_do_not_keep_the_lock(tmp_path, children):
    """A forked child (multiprocessing "fork") shares the lock's open file description: the module closes its
    copy in the child. An exec'd program never gets the descriptor (close-on-exec). Either child outlives the
    holder here, and the directory is free once the holder is gone."""
    holder, pids = start_holder(tmp_path, children)
    try:
        assert len(pids) == 1
        holder.kill()
        holder.wait()
        assert alive(pids[0])
        # A forked child closes its copy in its at-fork hook, which runs when the child is first scheduled: on
        # a busy machine that can be after the holder's death. Within seconds, not the child's 600 s of life.
        deadline = time.monotonic() + 15
        while True:
            try:
                acquire(tmp_path).release()
                break
            except RunDirBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert alive(pids[0])  # freed while the child lives on, not by its end
    finally:
        holder.kill()
        holder.wait()
        for pid in pids:
            kill(pid)


def test_a_filesystem_without_locks_is_said_so(tmp_path, monkeypatch):
    """flock's answer on a mount without locks (NFS without its lock manager: ENOLCK) is LockUnsupported naming
    the file, not a busy directory and not a bare OSError; the descriptor is closed."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LockUnsupported, match=rf"^{tmp_path / LOCK_FILE}: the filesystem keeps no locks \("):
        acquire(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == before
