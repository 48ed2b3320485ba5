"""Replace a prepared store only once its successor is complete (``kb.prepare --overwrite``).

The new store is built in a sibling directory, ``.<name>.new`` (same file system, so
the swap is two renames; a fixed name, so an interrupted build resumes there). Until
the swap, ``<name>`` is the old store, untouched: a bad line or a duplicate id found
while building leaves it exactly as it was. The swap::

    <name>          -> .<name>.old     (1)
    .<name>.new     -> <name>          (2)
    .<name>.old     removed            (3)

A kill between (1) and (2) leaves no ``<name>``; :func:`recover` finishes the swap
(the new store is complete, it has its manifest) or puts the old store back.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from dist_nce.core.artifacts import MANIFEST


def _named(out: str | os.PathLike) -> Path:
    # Absolute, so that "." or "data/kb/" still has a name to derive siblings from.
    return Path(os.path.abspath(out))


def staging_dir(out: str | os.PathLike) -> Path:
    out = _named(out)
    return out.parent / f".{out.name}.new"


def retired_dir(out: str | os.PathLike) -> Path:
    out = _named(out)
    return out.parent / f".{out.name}.old"


def swap_in(new: str | os.PathLike, out: str | os.PathLike) -> None:
    """Put the complete store ``new`` at ``out``; the old store stays whole until then."""
    new, out, old = Path(new), Path(out), retired_dir(out)
    if not (new / MANIFEST).is_file():
        raise RuntimeError(f"{new}: refusing to swap in a store without its manifest")
    shutil.rmtree(old, ignore_errors=True)  # left by a swap killed during (3)
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def recover(out: str | os.PathLike, log: Callable[[str], None] = print) -> None:
    """Finish, or undo, a swap that was killed part-way (a no-op when none was)."""
    out, old, new = Path(out), retired_dir(out), staging_dir(out)
    if not old.exists():
        return
    if not out.exists():
        if (new / MANIFEST).is_file():
            os.replace(new, out)
            log(f"{out}: finished replacing the store (the previous run was stopped while swapping it in)")
        else:
            os.replace(old, out)
            log(f"{out}: restored the previous store (a replacement was stopped while swapping it in)")
    shutil.rmtree(old, ignore_errors=True)
