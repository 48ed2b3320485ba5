"""A shard's persisted embedding versions: one self-describing directory per version.

Layout of a shard directory (``<shard_dir>/shard-003-of-008``)::

    v00000007/embeddings.safetensors   "vecs" [n, ...] in the storage dtype; "mask" when multi-vector
    v00000007/manifest.json            kind "shard_embeddings": rows [a, b), n, shape, dtype, version,
                                       encoder fingerprint, store fingerprint, score spec, kb_version
    v00000008/piece-<a>-<b>.safetensors  rows a KB delta placed on this shard (docs/design.md section 6)
    v00000008/manifest.json            ``base_in`` (the version whose embeddings.safetensors holds the base
                                       range) and ``pieces`` (each appended range and the version holding it)

A version records the KB version it encodes (``kb_version``; absent = 0). A KB delta writes
a version holding only the new rows' files: its manifest points at the earlier versions
that hold the rest, and :meth:`PersistedVersions.prune` never deletes a version a kept one
points at.

Each version directory is written to a temporary sibling and renamed into place
(``artifacts.atomic_path``), so a directory under its final name is always complete.
A writer killed on the way (SIGKILL, a lost node) leaves that sibling,
``.v00000007.<random>.tmp``, as large as what it had written. Writers therefore hold
``.writers.lock`` (``flock``, shared) while they write, and each write first removes the
temporaries of the directory when it can take that lock exclusively
(:meth:`PersistedVersions.sweep_temps`): then no writer is alive there, and every
temporary is a dead one's. The kernel releases a killed process's lock, so no pid or
age guesses are needed, and a live writer's temporary is never touched (``flock`` on
NFS is emulated with POSIX locks, which hold across clients).
A reader states the identity it expects (rows, store, spec, storage dtype) and a
version whose manifest disagrees is refused with the field that differs: embeddings of
another row range, store or score function must never be served.

``serving.json`` (``{"ceiling": v}``), present only while versions above ``v`` are on disk that the
shard went back below (a rerun serving its checkpoint's version again): they are a killed run's, kept
for a replay to reuse (same weights) or to be written over, and a restarted shard must not serve one
(:meth:`PersistedVersions.ceiling`).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from dist_nce.core.artifacts import ArtifactMismatch, atomic_path, atomic_write_json, read_manifest, write_manifest
from dist_nce.modeling.scoring import Reps

KIND = "shard_embeddings"
SCHEMA_VERSION = 1
EMBEDDINGS_FILE = "embeddings.safetensors"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
# atomic_path's temporary for a version directory: "." + version_dir_name + "." + mkstemp's random + ".tmp"
_VERSION_TEMP = re.compile(r"^\.v\d{8,}\.[^/]+\.tmp$")
WRITERS_LOCK = ".writers.lock"
SERVING_FILE = "serving.json"


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:03d}-of-{num_shards:03d}"


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def piece_file_name(a: int, b: int) -> str:
    return f"piece-{a:012d}-{b:012d}.safetensors"


def _tensors(reps: Reps) -> dict[str, Tensor]:
    tensors = {"vecs": reps.vecs.contiguous()}
    if reps.mask is not None:
        tensors["mask"] = reps.mask.contiguous()
    return tensors


def _piece_entry(a: int, b: int, version: int, reps: Reps) -> dict:
    return {"rows": [int(a), int(b)], "in": int(version), "shape": list(reps.vecs.shape),
            "dtype": str(reps.vecs.dtype).removeprefix("torch."), "has_mask": reps.mask is not None}


def shard_identity(rows: tuple[int, int], store_fingerprint: str, spec: Mapping[str, Any], storage_dtype: str,
                   dim: int) -> dict[str, Any]:
    """The identity (:class:`PersistedVersions`) of the shard serving store ``rows`` [a, b): every
    writer of a shard's versions (the shard itself, ``jobs/import_encodings.py``) states the same."""
    return {"rows": [int(rows[0]), int(rows[1])], "store_fingerprint": store_fingerprint, "spec": dict(spec),
            "storage_dtype": storage_dtype, "dim": int(dim)}


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_vecs_streamed(path: Path, shape: Sequence[int], dtype: torch.dtype, chunks: Iterable[Tensor]) -> None:
    """A safetensors file holding one tensor "vecs" ``shape`` of ``dtype``, written from row
    ``chunks`` as they come (the format: u64 header length, JSON header padded to 8 bytes, data)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"write_vecs_streamed: dtype {dtype} not one of {list(_SAFETENSORS_DTYPES)}")
    rows, row_shape = int(shape[0]), [int(s) for s in shape[1:]]
    nbytes = rows * math.prod(row_shape) * dtype.itemsize
    header = json.dumps({"vecs": {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": [rows, *row_shape],
                                  "data_offsets": [0, nbytes]}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    written = 0
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for chunk in chunks:
            if chunk.dtype != dtype or list(chunk.shape[1:]) != row_shape or chunk.device.type != "cpu":
                raise ValueError(f"write_vecs_streamed: a chunk is {chunk.dtype} {list(chunk.shape)} on "
                                 f"{chunk.device}, expected CPU {dtype} [*, {', '.join(map(str, row_shape))}]")
            if written + chunk.shape[0] > rows:
                raise ValueError(f"write_vecs_streamed: chunks hold more than the {rows} rows announced")
            f.write(chunk.contiguous().view(-1).view(torch.uint8).numpy().data)
            written += int(chunk.shape[0])
    if written != rows:
        raise ValueError(f"write_vecs_streamed: chunks held {written} rows, {rows} announced")


class PersistedVersions:
    """The version directories of one shard, checked against ``identity``.

    ``identity``: the manifest fields every version must carry unchanged (JSON values,
    e.g. ``{"rows": [a, b], "store_fingerprint": ..., "spec": {...}, "storage_dtype": ...}``).
    """

    def __init__(self, directory: str | os.PathLike, identity: Mapping[str, Any]):
        self.directory = Path(directory)
        self.identity = dict(identity)

    def path(self, version: int) -> Path:
        return self.directory / version_dir_name(version)

    def versions(self) -> list[int]:
        """Versions with a finished directory (a manifest), ascending; not yet checked."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _VERSION_DIR.match(child.name)
            if match and (child / "manifest.json").is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[int]:
        """An open descriptor of the directory's writer lock file (created if need be)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / WRITERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            yield fd
        finally:
            os.close(fd)  # releases whatever lock it held

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Sweep dead writers' temporaries, then hold the writer lock (shared) for one version's write."""
        with self._lock() as fd:
            self._sweep(fd)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep holds it
            yield

    def sweep_temps(self) -> list[str]:
        """Remove the temporary version directories that writers killed on the way left here, if no
        writer is alive in this directory (module docstring); returns the names removed."""
        if not self.directory.is_dir():
            return []
        with self._lock() as fd:
            return self._sweep(fd)

    def _sweep(self, fd: int) -> list[str]:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # a writer is alive: its temporary is not ours to remove; a later write sweeps
        try:
            removed = []
            for child in self.directory.iterdir():
                if _VERSION_TEMP.match(child.name):
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
                    removed.append(child.name)
            return sorted(removed)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def save(self, version: int, reps: Reps, pieces: Sequence[tuple[int, int, Reps]] = (), **fields: Any) -> dict:
        """Write ``reps`` (CPU tensors) of the base range, and the reps of appended ``pieces``
        (a, b, reps), as ``version`` atomically; return the manifest."""
        with self._writing(), atomic_path(self.path(version)) as tmp:
            tmp.mkdir()
            save_file(_tensors(reps), str(tmp / EMBEDDINGS_FILE))
            for a, b, piece in pieces:
                save_file(_tensors(piece), str(tmp / piece_file_name(a, b)))
            return self._write_base_manifest(tmp, version, reps.vecs.shape, reps.vecs.dtype, reps.mask is not None,
                                             [_piece_entry(a, b, version, p) for a, b, p in pieces], fields)

    def save_streamed(self, version: int, shape: Sequence[int], dtype: torch.dtype, chunks: Iterable[Tensor],
                      **fields: Any) -> dict:
        """Write ``version`` (single-vector, no pieces) whose "vecs" [n, d] arrive as ``chunks``: CPU
        tensors of ``dtype``, consecutive rows in order. One chunk is held at a time, so a shard
        of any size is written in the memory of a chunk (``jobs/import_encodings.py``). Atomic, as
        :meth:`save`; returns the manifest."""
        shape = [int(s) for s in shape]
        with self._writing(), atomic_path(self.path(version)) as tmp:
            tmp.mkdir()
            write_vecs_streamed(tmp / EMBEDDINGS_FILE, shape, dtype, chunks)
            return self._write_base_manifest(tmp, version, shape, dtype, False, [], fields)

    def _write_base_manifest(self, tmp: Path, version: int, shape: Sequence[int], dtype: torch.dtype,
                             has_mask: bool, pieces: list[dict], fields: Mapping[str, Any]) -> dict:
        return write_manifest(
            tmp, KIND, SCHEMA_VERSION, version=int(version), n=int(shape[0]), shape=[int(s) for s in shape],
            dtype=str(dtype).removeprefix("torch."), has_mask=has_mask, base_in=int(version), pieces=pieces,
            **self.identity, **fields)

    def save_delta(self, version: int, base: Mapping[str, Any], new: Sequence[tuple[int, int, Reps]],
                   **fields: Any) -> dict:
        """Write ``version`` as the version ``base`` (a manifest of this shard) plus the reps of
        the ``new`` pieces (a, b, reps) only; the base range and earlier pieces stay where they
        are (``base_in``, ``pieces[i]["in"]``). Returns the manifest."""
        with self._writing(), atomic_path(self.path(version)) as tmp:
            tmp.mkdir()
            for a, b, piece in new:
                save_file(_tensors(piece), str(tmp / piece_file_name(a, b)))
            keep = {k: base[k] for k in ("n", "shape", "dtype", "has_mask")}
            return write_manifest(
                tmp, KIND, SCHEMA_VERSION, version=int(version), base_in=int(base.get("base_in", base["version"])),
                pieces=[*base.get("pieces", []), *(_piece_entry(a, b, version, p) for a, b, p in new)],
                **keep, **self.identity, **fields)

    def load_piece(self, entry: Mapping[str, Any]) -> Reps:
        """The reps of an appended piece (an entry of a manifest's ``pieces``), checked."""
        a, b = entry["rows"]
        file = self.path(int(entry["in"])) / piece_file_name(a, b)
        try:
            tensors = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - missing file, truncated header (SafetensorError)
            raise ArtifactMismatch(f"{file}: unreadable: {e}") from None
        vecs, mask = tensors.get("vecs"), tensors.get("mask")
        if vecs is None or list(vecs.shape) != entry["shape"] or vecs.shape[0] != b - a or \
                str(vecs.dtype).removeprefix("torch.") != entry["dtype"] or (mask is not None) != entry["has_mask"]:
            got = None if vecs is None else f"{vecs.dtype} {list(vecs.shape)}"
            raise ArtifactMismatch(f"{file}: 'vecs' is {got}, manifest says {entry['dtype']} {entry['shape']}")
        return Reps(vecs, mask)

    def referenced(self, version: int) -> set[int]:
        """The versions whose files ``version`` reads (itself, its base's, its pieces')."""
        m = self.manifest(version)
        return {int(version), int(m.get("base_in", version)), *(int(p["in"]) for p in m.get("pieces", []))}

    def manifest(self, version: int) -> dict:
        """The manifest of ``version``; :class:`ArtifactMismatch` if it is not this shard's."""
        return read_manifest(self.path(version), KIND, SCHEMA_VERSION,
                             expect={"version": int(version), **self.identity})

    def load(self, version: int) -> tuple[Reps, dict]:
        """(reps, manifest) of ``version``, refusing a manifest or file that disagrees."""
        manifest = self.manifest(version)
        file = self.path(version) / EMBEDDINGS_FILE
        try:
            tensors = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - missing file, truncated header (SafetensorError)
            raise ArtifactMismatch(f"{file}: unreadable: {e}") from None
        vecs, mask = tensors.get("vecs"), tensors.get("mask")
        if vecs is None or list(vecs.shape) != manifest["shape"] or \
                str(vecs.dtype).removeprefix("torch.") != manifest["dtype"]:
            got = None if vecs is None else f"{vecs.dtype} {list(vecs.shape)}"
            raise ArtifactMismatch(f"{file}: 'vecs' is {got}, manifest says {manifest['dtype']} {manifest['shape']}")
        if (mask is not None) != manifest["has_mask"] or (mask is not None and mask.shape != vecs.shape[:-1]):
            raise ArtifactMismatch(f"{file}: 'mask' does not match the manifest (has_mask={manifest['has_mask']}) "
                                   f"or vecs {list(vecs.shape)}")
        return Reps(vecs, mask), manifest

    def read_vecs_into(self, version: int, out: Tensor, chunk_bytes: int = 1 << 26) -> dict:
        """Read ``version``'s "vecs" straight into ``out`` (CPU, contiguous, the manifest's shape and
        dtype) by plain file reads of ``chunk_bytes``; returns the manifest.

        Neither a second copy of the vectors nor a mapping of the file (whose touched pages
        would count in the process's resident memory): the peak is ``out`` itself.
        """
        manifest = self.manifest(version)
        if manifest["has_mask"]:
            raise ValueError(f"read_vecs_into: version {version} has a mask; use load()")
        if (list(out.shape) != manifest["shape"] or str(out.dtype).removeprefix("torch.") != manifest["dtype"]
                or out.device.type != "cpu" or not out.is_contiguous()):
            raise ValueError(f"read_vecs_into: out must be a contiguous CPU {manifest['dtype']} "
                             f"{manifest['shape']} tensor, got {out.dtype} {list(out.shape)} on {out.device}")
        file = self.path(version) / EMBEDDINGS_FILE
        dest = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")  # safetensors: u64 header length, JSON header, data
                entry = json.loads(f.read(size))["vecs"]
                begin, end = entry["data_offsets"]
                if entry["shape"] != manifest["shape"] or end - begin != dest.nbytes:
                    raise ArtifactMismatch(f"{file}: 'vecs' is {entry['shape']} ({end - begin} bytes), manifest "
                                           f"says {manifest['shape']} ({dest.nbytes} bytes)")
                f.seek(8 + size + begin)
                for a in range(0, dest.nbytes, chunk_bytes):
                    part = dest[a:a + chunk_bytes]
                    if f.readinto(part) != part.nbytes:
                        raise ArtifactMismatch(f"{file}: truncated")
        except (OSError, KeyError, TypeError, ValueError) as e:  # missing file, bad header
            raise ArtifactMismatch(f"{file}: unreadable: {e}") from None
        return manifest

    def ceiling(self) -> int | None:
        """The newest version a restarted shard may serve, when versions above it on disk are a killed
        run's (module docstring); None: any."""
        file = self.directory / SERVING_FILE
        try:
            value = json.loads(file.read_text(encoding="utf-8"))["ceiling"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ArtifactMismatch(f"{file}: unreadable ({e}); remove it to serve the newest version") from None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArtifactMismatch(f"{file}: 'ceiling' must be an integer, got {value!r}")
        return value

    def mark_served(self, version: int) -> None:
        """Record that ``version`` is served: the ceiling while any version above it is on disk, else
        none."""
        above = any(v > version for v in self.versions())
        try:
            current = self.ceiling()
        except ArtifactMismatch:
            current = None  # written over below: this call knows what is served
        if above and current != version:
            atomic_write_json(self.directory / SERVING_FILE, {"ceiling": int(version)})
        elif not above and (self.directory / SERVING_FILE).exists():
            (self.directory / SERVING_FILE).unlink(missing_ok=True)

    def valid_versions(self) -> list[int]:
        """Versions whose manifest matches this shard's identity, ascending."""
        valid = []
        for version in self.versions():
            try:
                self.manifest(version)
            except ArtifactMismatch:
                continue
            valid.append(version)
        return valid

    def prune(self, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
        """Delete all but the newest ``keep`` valid versions (never one in ``protect``).

        Refused directories (another store or spec) are left for a person to look at."""
        deleted = []
        valid = self.valid_versions()
        kept = set(valid[-keep:] if keep > 0 else []) | set(protect)
        needed = set()
        for version in kept & set(valid):
            try:
                needed |= self.referenced(version)
            except ArtifactMismatch:
                continue
        for version in valid[:-keep] if keep > 0 else valid:
            if version not in protect and version not in needed:
                shutil.rmtree(self.path(version), ignore_errors=True)
                deleted.append(version)
        return deleted
