"""One live job per run directory: an exclusive ``flock`` on ``<directory>/.lock``, held by the job's
driver process from before any cluster work until it ends.

Why: two jobs started on one ``run.output_dir`` (the same ``run.name`` submitted twice with ``ray job
submit``, or a rerun typed while the first still trains) both trained into it: checkpoints,
``metrics.jsonl``, ``summary.json``, Ray Train storage and exports of two runs interleaved, and nothing
said so. The second job now stops before it starts anything (:class:`RunDirBusy` names the holder).

Why ``flock``: the kernel drops the lock when the holder's last descriptor of it closes, which a process's
death does, SIGKILL and the OOM killer included. So there is no stale lock to clear and no pid or age to
guess: a run that crashed resumes with the same command. The holder writes its pid, host and start time
into the file after it has the lock; that text only names the holder in the refusal, the lock is the
``flock`` alone (a file left by a dead job is simply taken again).

Descriptors and children. The file is opened close-on-exec (Python's default, PEP 446), so a program the
job starts (``ray start``, Ray's own processes, a grid's cell jobs, the compiler of the native kernels)
does not hold the lock, even if it outlives the job. A child made by ``fork()`` without ``exec``
(``multiprocessing``'s "fork" start method) would share the lock's open file description and keep the
directory locked until that child exits, after the job itself died: this module closes its descriptors in
every child that Python's ``os.fork`` makes (``os.register_at_fork``); closing a child's copy leaves the
parent's lock in place. A fork made in C code runs no such hook and is not covered; the jobs' drivers make
none that is known to outlive them (their process pools use "spawn", which execs: ``kb/ingest.py``,
``kb/synthetic/kilt.py``).

Limits. ``flock`` excludes processes of one machine. Across machines that share the directory over a
network filesystem it holds only where that filesystem carries the lock to its server: Linux NFS clients
turn ``flock`` into NFS byte-range locks, which do; mounts without server-side locking (NFS with
``nolock``, many FUSE mounts of object stores, Lustre without ``-o flock``) lock per machine or not at all.
A filesystem that refuses locks raises :class:`LockUnsupported`, and the caller decides (the jobs warn and
run unguarded).
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"
# flock's answers on a filesystem that keeps no locks (ENOLCK: an NFS mount without its lock manager; ENOSYS:
# Lustre mounted noflock)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HELD: dict[int, "RunLock"] = {}  # descriptor -> the lock this process holds through it


class RunDirBusy(Exception):
    """Another live process holds the lock: the message names ``what``, the holder and what to do."""

    def __init__(self, what: str, path: Path, holder: dict[str, Any] | None, instead: str):
        self.what, self.path, self.holder = what, path, holder
        super().__init__(f"{what} is in use by another job ({describe(holder)}; lock {path}): wait for it to "
                         f"end, stop it, or {instead}")


class LockUnsupported(Exception):
    """The filesystem of ``path`` keeps no ``flock`` locks (errno ENOLCK, EOPNOTSUPP, ENOSYS or EINVAL)."""

    def __init__(self, path: Path, error: OSError):
        self.path = path
        super().__init__(f"{path}: the filesystem keeps no locks ({os.strerror(error.errno)})")


class RunLock:
    """A lock :func:`acquire` took; held until :meth:`release` (or the end of a ``with``) or the process's end."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd
        _HELD[fd] = self

    @property
    def held(self) -> bool:
        # by identity: a released lock's descriptor number may serve a later lock
        return _HELD.get(self._fd) is self

    def release(self) -> None:
        """Close the lock's descriptor, which releases it; again, or in a forked child: nothing."""
        if self.held:
            del _HELD[self._fd]
            os.close(self._fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(directory: str | os.PathLike, *, name: str = LOCK_FILE, what: str | None = None,
            instead: str = "use another run directory") -> RunLock:
    """Lock ``<directory>/<name>`` (the directory made if missing) for this process, without waiting.

    Raises :class:`RunDirBusy` when another process holds it (its message: ``what``, default the directory,
    the holder's pid, host and start, then "wait for it to end, stop it, or ``instead``"),
    :class:`LockUnsupported` on a filesystem without locks, OSError (naming the path) when the directory or
    the file cannot be made. Locking a file this process already holds through another :class:`RunLock`
    is refused too: each lock is its own open file description."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    # O_RDWR (NFS emulates flock with a write lock, which needs a file open for writing) | O_CREAT, never
    # O_TRUNC: a refused job must still read the holder's record
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise RunDirBusy(what or str(directory), path, holder, instead) from None
    except OSError as e:
        os.close(fd)
        if e.errno in _UNSUPPORTED:
            raise LockUnsupported(path, e) from None
        raise
    lock = RunLock(path, fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)[:500]}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:  # a full disk, say: the lock holds all the same, only a refusal cannot name us
        pass
    return lock


def describe(record: dict[str, Any] | None) -> str:
    """A holder's record in words: ``pid 123 on host h, since 2026-12-01T10:00:00+00:00``."""
    if not record:  # between the holder's flock and its write, or a file of another program
        return "holder not named yet"
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, since {record.get('since', '?')}"


def _read(fd: int) -> dict[str, Any] | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, OSError):
        return None
    return record if isinstance(record, dict) else None


def _forget_in_child() -> None:
    """In a child of ``os.fork``: close the copies of this process's lock descriptors (module docstring)."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)
