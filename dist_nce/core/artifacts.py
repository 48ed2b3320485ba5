"""Self-describing artifacts: atomic writes and ``manifest.json`` files.

Every artifact directory (prepared KB, embedding snapshot, index shard, checkpoint,
exported model) carries a ``manifest.json`` with at least ``kind`` and
``schema_version``. Readers call :func:`read_manifest` with what they expect and get
an :class:`ArtifactMismatch` naming the file and the differing field.

Writes go to a temporary sibling and are renamed into place, so an interrupted write
never leaves a half-written file under the final name.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

MANIFEST = "manifest.json"


class ArtifactMismatch(ValueError):
    """An artifact on disk is not what the reader expects."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success.

    Works for files and directories. On an exception the temporary is removed and
    ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if path.is_dir() and tmp_path.is_dir():
            # os.replace cannot swap non-empty directories; move the old one aside first.
            old = path.with_name(f".{path.name}.old")
            _rmtree(old)
            os.replace(path, old)
            os.replace(tmp_path, path)
            _rmtree(old)
        else:
            os.replace(tmp_path, path)
    except BaseException:
        _rmtree(tmp_path)
        raise


def _rmtree(p: Path) -> None:
    import shutil

    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike, kind: str, schema_version: int, **fields: Any) -> dict:
    """Write ``directory/manifest.json`` atomically and return its content."""
    from dist_nce import __version__

    manifest = {
        "kind": kind,
        "schema_version": schema_version,
        "dist_nce_version": __version__,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **fields,
    }
    atomic_write_json(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(
    directory: str | os.PathLike,
    kind: str | None = None,
    schema_version: int | None = None,
    expect: Mapping[str, Any] | None = None,
) -> dict:
    """Read and check ``directory/manifest.json``.

    Raises :class:`ArtifactMismatch` naming the manifest path and the field when the
    manifest is missing, of another ``kind``, another ``schema_version``, or differs
    from any ``expect`` entry.
    """
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise ArtifactMismatch(f"{path}: no manifest; {directory} is not a dist-nce artifact (or was not finished)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ArtifactMismatch(f"{path}: not valid JSON: {e}") from None
    checks = dict(expect or {})
    if kind is not None:
        checks = {"kind": kind, **checks}
    if schema_version is not None:
        checks = {"schema_version": schema_version, **checks}
    for key, want in checks.items():
        got = manifest.get(key)
        if got != want:
            raise ArtifactMismatch(f"{path}: field {key!r} is {got!r}, expected {want!r}")
    return manifest
