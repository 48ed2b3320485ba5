"""Scratch files in the system's temporary directory that a killed process does not leave there for good.

A training worker stages each checkpoint in a temporary directory before Ray Train copies it to
``run.storage_path``. A worker killed while it stages (the OOM killer, Ray Train restarting a failed
group under ``run.max_failures``, a chaos test) never reaches the cleanup, and its part of a DeepSpeed
checkpoint stays in /tmp: for a BERT-large dual encoder under ZeRO, gigabytes per rank and per kill,
until /tmp fills and the next checkpoint fails. Likewise the torch FileStore of a process group whose
Ray Train controller was killed.

So scratch names carry the machine and the id of the process that made them
(``<prefix><host>_<pid>_<random>``), and whoever makes the next one under the same prefix removes
those of its machine whose process is gone. Never removed: an entry of another user, a symbolic link,
an entry of a live process, one made on another machine or in another process-id namespace (a /tmp
shared between containers that do not see each other's processes), or one without that pattern (made
by another program or version).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Iterator


def host_tag() -> str:
    """Eight hex digits naming this machine (its hostname) and, on Linux, the process-id namespace in
    which the process ids of scratch names mean something (containers with the host's hostname)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha1(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_orphans(prefix: str, where: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's ``<prefix><host>_<pid>_*`` entries of this machine in ``where`` (the
    temporary directory) whose process is gone; returns what was removed."""
    root = Path(where or tempfile.gettempdir())
    mine = f"{prefix}{host_tag()}_"
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(mine):
            continue
        pid_text = entry.name[len(mine):].split("_", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid():
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry.path)
            elif stat.S_ISREG(st.st_mode):
                os.unlink(entry.path)
            else:  # a link or anything else: not ours to follow
                continue
        except FileNotFoundError:  # removed meanwhile by another process doing the same
            continue
        except OSError:  # e.g. a file inside that is not ours: leave the rest
            continue
        removed.append(Path(entry.path))
    return removed


def scratch_name(prefix: str, pid: int | None = None) -> str:
    """``<prefix><host>_<pid>_``: the start of the scratch entries' names made by process ``pid`` on this
    machine (default: this process)."""
    return f"{prefix}{host_tag()}_{os.getpid() if pid is None else pid}_"


@contextlib.contextmanager
def scratch_dir(prefix: str, where: str | os.PathLike | None = None) -> Iterator[str]:
    """A new private directory (mode 0700) in the temporary directory, removed on exit; orphans of
    ``prefix`` are removed first (:func:`remove_orphans`)."""
    remove_orphans(prefix, where)
    with tempfile.TemporaryDirectory(prefix=scratch_name(prefix), dir=where) as path:
        yield path


def scratch_file_path(prefix: str, where: str | os.PathLike | None = None) -> str:
    """A path for a new file in the temporary directory (not created; the caller removes it);
    orphans of ``prefix`` are removed first (:func:`remove_orphans`)."""
    remove_orphans(prefix, where)
    return os.path.join(where or tempfile.gettempdir(), scratch_name(prefix) + uuid.uuid4().hex)
