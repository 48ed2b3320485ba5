"""Tie a worker process's life to its parent's, so no worker outlives the job that started it.

A pool worker whose parent is killed (SIGKILL, OOM killer) is not told: it finishes
the chunks already queued to it, then blocks forever on a queue nobody feeds, holding
its memory (hundreds of MB with a tokenizer and torch loaded). :func:`exit_with_parent`,
run first in every worker, closes that gap two ways:

* Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel kills the worker the moment
  its parent exits, however the parent died. (The signal follows the parent *thread*
  that started the worker; pools start theirs from the caller's thread, which lives as
  long as the pool.)
* everywhere: a daemon thread that polls ``os.getppid()`` and ends the process once it
  changes (the worker was re-parented, so its parent is gone). This also covers the
  window before ``prctl`` ran, and systems without ``prctl``.

Killing a worker mid-chunk loses nothing: chunk outputs are written to a temporary
name and renamed, and an unfinished chunk is redone by the next run.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
# How often the portable watchdog looks at the parent: the bound on how long an
# orphan lives where prctl is unavailable.
POLL_SECONDS = 0.5
ORPHAN_EXIT_CODE = 70


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when the parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int, poll: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll)
    # os._exit, not sys.exit: the main thread may be blocked inside a queue read or
    # native code, and no cleanup of an orphan is worth waiting for.
    os._exit(ORPHAN_EXIT_CODE)


def exit_with_parent(parent_pid: int, poll: float = POLL_SECONDS) -> None:
    """Make this process end when ``parent_pid`` (its parent at start) ends."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(ORPHAN_EXIT_CODE)
    threading.Thread(target=_watch, args=(parent_pid, poll), name="exit-with-parent", daemon=True).start()
