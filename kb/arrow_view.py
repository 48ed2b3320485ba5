"""Zero-copy NumPy views of Arrow columns without pyarrow's pandas shim.

``pa.Array.to_numpy`` imports pandas on first use (~0.6 s of CPU): every process that opens a
store (each entity shard, Serve replica and job) paid it only to view integer columns that are
already plain buffers in the memory-mapped file.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def _numpy_dtype(t: pa.DataType) -> np.dtype | None:
    if pa.types.is_integer(t):
        return np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if pa.types.is_floating(t):
        return np.dtype(f"f{t.bit_width // 8}")
    return None


def numpy_view(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free integer or float column -> read-only ``[n]`` array over its buffer (no copy when
    it has one chunk). Other types, or a column with nulls, go through ``to_numpy`` (a copy)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    dtype = _numpy_dtype(column.type)
    if dtype is None or column.null_count:
        return column.to_numpy(zero_copy_only=False)
    data = column.buffers()[1]
    if data is None or len(column) == 0:
        view = np.zeros(0, dtype)
    else:
        view = np.frombuffer(data, dtype=dtype, count=len(column), offset=column.offset * dtype.itemsize)
    view.flags.writeable = False  # frombuffer over a mutable buffer is writable; the file's is not
    return view


def arrow_indices(idx: np.ndarray) -> pa.Array:
    """``[n]`` integer positions -> an Arrow int64 array over the same memory (for ``take``):
    ``pa.array(ndarray)`` would import pandas to check what it was given."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(idx), [None, pa.py_buffer(idx)])
