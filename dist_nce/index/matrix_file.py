"""Read rows of a large 2-D matrix file without loading it: BLINK's ``all_entities_large.t7``, ``.npy``.

BLINK ships its entity encodings as one ``torch.save``'d float32 tensor, [5,903,527 x 1024]
(24 GB). ``torch.load`` materialises all of it, and even ``torch.load(mmap=True)`` maps it
(pages read count in the process's resident memory until the kernel drops them), and works
only for the zip format. Here the file is parsed just far enough to find where the tensor's
bytes start, and rows are then read with plain positioned reads into a caller's buffer:
resident memory is the buffer, whatever the file's size.

Formats (:func:`open_matrix`):

* ``torch.save``, zip format (torch >= 1.6): ``<archive>/data.pkl`` names the storage
  (``<archive>/data/<key>``, stored uncompressed); its bytes start after that member's
  local header.
* ``torch.save``, legacy format (``_use_new_zipfile_serialization=False``; torch < 1.6,
  which is what 2020 releases such as BLINK's used): pickles of a magic number, protocol
  version, system info, the object, then the sorted storage keys; then each storage as an
  int64 element count followed by its raw bytes, in that key order.
* ``.npy`` (C order): the array header, then the raw bytes.

The pickles are read by :class:`_TensorUnpickler`, which resolves no global but the few
that describe a tensor (``torch._utils._rebuild_tensor[_v2]``, ``torch.<Type>Storage``,
``collections.OrderedDict``) and loads no storage: it only records where each tensor lives,
so a hostile file cannot run code (the same promise as ``weights_only=True``).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# torch.<Name>Storage -> numpy dtype; bfloat16 has no numpy dtype: read as uint16 and viewed by torch
_STORAGE_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                   "BFloat16Storage": np.uint16}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_ZIP_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's own sizeFileHeader (30 bytes)


class MatrixFileError(ValueError):
    """A matrix file that cannot be read as one 2-D tensor; the message names the file."""


@dataclass(frozen=True)
class MatrixFile:
    """Where a [rows, dim] row-major matrix lies in ``path``: ``offset`` is the byte of row 0."""

    path: Path
    format: str  # "torch-zip" | "torch-legacy" | "npy"
    rows: int
    dim: int
    dtype: np.dtype  # uint16 stands for bfloat16 (``bfloat16`` True)
    offset: int
    bfloat16: bool = False

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def describe(self) -> str:
        kind = "bfloat16" if self.bfloat16 else str(self.dtype)
        return f"{self.path} ({self.format}): {self.rows:,} x {self.dim} {kind}"


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: Any  # numpy dtype, or None when the storage class is unknown
    bfloat16: bool
    numel: int | None  # elements, when the reference carries it (legacy files)


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    def __init__(self, name: str):
        self.name = name


def _rebuild_tensor(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> _Tensor:
    return _Tensor(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save`` object graph into :class:`_Tensor` records, loading no storage."""

    _ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
                ("collections", "OrderedDict"): dict}

    def __init__(self, file: Any, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        raise MatrixFileError(f"{self.source}: refuses to load global {module}.{name} "
                              "(only a tensor, or a dict of tensors, is read)")

    def persistent_load(self, pid: Any) -> _Storage:
        # zip: ('storage', type, key, location, numel); legacy: (..., numel, view_metadata)
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise MatrixFileError(f"{self.source}: unexpected persistent id {pid!r:.80}")
        kind = pid[1]
        name = kind.name if isinstance(kind, _StorageType) else str(kind)
        return _Storage(str(pid[2]), _STORAGE_DTYPES.get(name), name == "BFloat16Storage", int(pid[4]))


def _only_tensor(obj: Any, source: str) -> _Tensor:
    """The one 2-D tensor of ``obj`` (a tensor, or a dict/list holding exactly one)."""
    found = [obj] if isinstance(obj, _Tensor) else [v for v in (obj.values() if isinstance(obj, dict) else
                                                              obj if isinstance(obj, (list, tuple)) else [])
                                                     if isinstance(v, _Tensor)]
    if len(found) != 1:
        raise MatrixFileError(f"{source}: expected one tensor (or a dict holding one), found {len(found)}")
    t = found[0]
    if len(t.size) != 2:
        raise MatrixFileError(f"{source}: expected a 2-D [entities, dim] tensor, got shape {list(t.size)}")
    if t.storage.dtype is None:
        raise MatrixFileError(f"{source}: unsupported storage type (float32, float64, float16, bfloat16 only)")
    rows, dim = t.size
    if rows > 1 and t.stride != (dim, 1) or rows == 1 and t.stride[1] != 1:
        raise MatrixFileError(f"{source}: the tensor is not row-major contiguous (stride {list(t.stride)}); "
                              "save tensor.contiguous()")
    return t


def _open_zip(path: Path) -> MatrixFile:
    try:
        return _read_zip(path)
    except (zipfile.BadZipFile, EOFError) as exc:  # a cut copy loses the zip's directory, stored at its end
        raise MatrixFileError(f"{path}: not a whole zip file (truncated or damaged: {exc}); "
                              "copy the torch.save file again") from None


def _read_zip(path: Path) -> MatrixFile:
    source = str(path)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise MatrixFileError(f"{source}: a zip without one data.pkl: not a torch.save file")
        prefix = pkl[0][: -len("data.pkl")]
        t = _only_tensor(_TensorUnpickler(io.BytesIO(z.read(pkl[0])), source).load(), source)
        member = f"{prefix}data/{t.storage.key}"
        try:
            info = z.getinfo(member)
        except KeyError:
            raise MatrixFileError(f"{source}: storage {member} missing") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise MatrixFileError(f"{source}: storage {member} is compressed; cannot read rows in place")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = _ZIP_LOCAL_HEADER.unpack(f.read(_ZIP_LOCAL_HEADER.size))
    name_len, extra_len = header[-2], header[-1]
    start = info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len
    dtype = np.dtype(t.storage.dtype)
    rows, dim = t.size
    if (t.offset + rows * dim) * dtype.itemsize > info.file_size:
        raise MatrixFileError(f"{source}: the tensor runs past its storage ({info.file_size} bytes)")
    return MatrixFile(path, "torch-zip", rows, dim, dtype, start + t.offset * dtype.itemsize, t.storage.bfloat16)


def _open_legacy(path: Path) -> MatrixFile:
    source = str(path)
    with open(path, "rb") as f:
        try:
            magic = _TensorUnpickler(f, source).load()
            protocol = _TensorUnpickler(f, source).load()
            if magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL:
                raise MatrixFileError(f"{source}: not a torch.save file (magic {magic!r:.40})")
            sys_info = _TensorUnpickler(f, source).load()
            if not isinstance(sys_info, dict) or not sys_info.get("little_endian", True):
                raise MatrixFileError(f"{source}: saved on a big-endian machine; not supported")
            t = _only_tensor(_TensorUnpickler(f, source).load(), source)
            keys = _TensorUnpickler(f, source).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
            raise MatrixFileError(f"{source}: unreadable torch.save header: {e}") from None
        if not isinstance(keys, list) or t.storage.key not in keys:
            raise MatrixFileError(f"{source}: storage keys {keys!r:.80} do not list the tensor's storage")
        if len(keys) != 1:  # storages follow in key order; the others' element sizes are not known here
            raise MatrixFileError(f"{source}: holds {len(keys)} storages; save the encodings tensor alone")
        head = f.read(8)  # the storage's element count, then its bytes
        start = f.tell()
        size = os.fstat(f.fileno()).st_size
    if len(head) != 8:
        raise MatrixFileError(f"{source}: truncated before the tensor's bytes")
    numel = int.from_bytes(head, "little", signed=True)
    dtype = np.dtype(t.storage.dtype)
    rows, dim = t.size
    if numel < t.offset + rows * dim or start + numel * dtype.itemsize > size:
        raise MatrixFileError(f"{source}: truncated: the tensor needs {(t.offset + rows * dim) * dtype.itemsize} "
                              f"bytes from offset {start}, the file has {size}")
    return MatrixFile(path, "torch-legacy", rows, dim, dtype, start + t.offset * dtype.itemsize, t.storage.bfloat16)


def _open_npy(path: Path) -> MatrixFile:
    source = str(path)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"format version {version} (1.0 and 2.0 are read)")
            shape, fortran, dtype = read_header(f)
        except ValueError as e:
            raise MatrixFileError(f"{source}: unreadable .npy header: {e}") from None
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    if len(shape) != 2:
        raise MatrixFileError(f"{source}: expected a 2-D [entities, dim] array, got shape {list(shape)}")
    if fortran:
        raise MatrixFileError(f"{source}: Fortran-ordered array; save it in C order")
    if dtype.hasobject or dtype.kind != "f" or not dtype.isnative:
        raise MatrixFileError(f"{source}: dtype {dtype} is not a native float")
    if offset + shape[0] * shape[1] * dtype.itemsize > size:
        raise MatrixFileError(f"{source}: truncated: {shape} {dtype} needs more than the file's {size} bytes")
    return MatrixFile(path, "npy", int(shape[0]), int(shape[1]), dtype, offset)


def open_matrix(path: str | os.PathLike) -> MatrixFile:
    """Locate the 2-D matrix in ``path`` (module docstring: torch zip, torch legacy or .npy)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: matrix file not found")
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith(b"\x93NUMPY"):
        return _open_npy(path)
    if head.startswith(b"PK"):
        return _open_zip(path)
    if head[:1] == b"\x80":  # a pickle: the legacy torch.save stream
        return _open_legacy(path)
    raise MatrixFileError(f"{path}: neither a torch.save file nor a .npy array")


def read_rows(matrix: MatrixFile, a: int, b: int, out: np.ndarray | None = None, file: Any = None) -> np.ndarray:
    """Rows [a, b) as an array [b - a, dim] of the file's dtype (uint16 for bfloat16), read into
    ``out`` when given (C-contiguous, that shape and dtype); ``file``: ``matrix.path`` already
    open (binary, unbuffered), for many small reads."""
    if not 0 <= a <= b <= matrix.rows:
        raise IndexError(f"rows [{a}, {b}) outside {matrix.describe()}")
    if out is None:
        out = np.empty((b - a, matrix.dim), dtype=matrix.dtype)
    elif out.shape != (b - a, matrix.dim) or out.dtype != matrix.dtype or not out.flags.c_contiguous:
        raise ValueError(f"read_rows: out must be C-contiguous {matrix.dtype} {(b - a, matrix.dim)}, "
                         f"got {out.dtype} {out.shape}")
    view = memoryview(out.reshape(-1).view(np.uint8))
    with contextlib.nullcontext(file) if file is not None else open(matrix.path, "rb", buffering=0) as f:
        f.seek(matrix.offset + a * matrix.row_bytes)
        done = 0
        while done < view.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise MatrixFileError(f"{matrix.path}: truncated at row {a + done // matrix.row_bytes}")
            done += got
    return out
