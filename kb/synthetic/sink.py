"""Atomic JSON-lines output that counts and hashes what it writes."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from dist_nce.core.artifacts import atomic_path


class JsonlSink:
    """Append JSON objects, one per line, to a temporary file that is renamed onto
    ``path`` only when the surrounding ``ExitStack`` closes without an error."""

    def __init__(self, stack: contextlib.ExitStack, path: str | os.PathLike):
        self.path = Path(path)
        tmp = stack.enter_context(atomic_path(self.path))
        # Registered after atomic_path, so the file is closed before the rename.
        self._f = stack.enter_context(open(tmp, "wb", buffering=1 << 20))
        self._sha = hashlib.sha256()
        self.lines = 0

    def write(self, obj: dict[str, Any]) -> None:
        self.write_encoded((json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8"), 1)

    def write_encoded(self, data: bytes, lines: int) -> None:
        """Append ``lines`` already-encoded JSON lines (each ending in a newline)."""
        self._f.write(data)
        self._sha.update(data)
        self.lines += lines

    def summary(self) -> dict[str, Any]:
        """``{"lines", "sha256"}`` for the manifest (valid once writing is finished)."""
        return {"lines": self.lines, "sha256": self._sha.hexdigest()}
