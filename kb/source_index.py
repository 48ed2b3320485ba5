"""Source id -> row id without a Python dict over millions of ids.

Ids are stored as one sorted fixed-width byte array (numpy ``S<w>``, NUL padded; ``w``
= the longest id in UTF-8 bytes, 8 for KILT's wikipedia_ids, 16 for Zeshel's hex ids)
next to their row ids, in an Arrow file the store memory-maps. A lookup is one
vectorised ``np.searchsorted``: 5.9M KILT ids cost 47 MB of mapped keys and no
Python objects.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kb.arrow_view import numpy_view

_BLOCK = 1 << 20



def fixed_width_keys(ids: pa.Array | pa.ChunkedArray, width: int) -> np.ndarray:
    """Arrow strings -> ``np.ndarray`` of dtype ``S<width>`` (NUL padded), vectorised.

    Ids longer than ``width`` bytes or containing NUL raise ``ValueError`` (NUL padding
    would make them collide).
    """
    if isinstance(ids, pa.ChunkedArray):
        parts = [fixed_width_keys(c, width) for c in ids.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=f"S{width}")
    ids = ids.cast(pa.string())
    if ids.null_count:
        raise ValueError("source ids must not be null")
    n = len(ids)
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int32)[ids.offset : ids.offset + n + 1]
    data = np.frombuffer(ids.buffers()[2], dtype=np.uint8) if n else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    if n and lengths.max() > width:
        raise ValueError(f"a source id is longer than the index width {width}")
    body = data[offsets[0] : offsets[-1]]
    if (body == 0).any():
        raise ValueError("source ids must not contain NUL bytes")
    width = max(width, 1)
    out = np.zeros((n, width), dtype=np.uint8)
    starts = offsets[:-1] - offsets[0]
    # One fancy-indexed copy per distinct id length (at most ``width`` of them), in
    # blocks so the index arrays stay small for millions of ids.
    for length in np.unique(lengths):
        if length == 0:
            continue
        rows = np.flatnonzero(lengths == length)
        for a in range(0, len(rows), _BLOCK):
            r = rows[a:a + _BLOCK]
            out[r, :length] = body[starts[r, None] + np.arange(length)]
    return out.view(f"S{width}").reshape(n)


def argsort_keys(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of ``S<w>`` keys in byte order, equal to ``np.argsort(keys,
    kind="stable")`` but sorting big-endian uint64 words (several times faster than
    numpy's string sort at millions of keys)."""
    n, width = len(keys), keys.dtype.itemsize
    words = -(-width // 8)
    mat = np.zeros((n, 8 * words), dtype=np.uint8)
    mat[:, :width] = keys.view(np.uint8).reshape(n, width)
    cols = mat.view(">u8")  # [n, words]; big-endian, so integer order is byte order
    if words == 1:
        return np.argsort(cols[:, 0], kind="stable")
    return np.lexsort(cols.T[::-1])  # lexsort is stable; its last key is the primary one


def sort_source_keys(ids: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, order)``: ids as ``S<w>`` keys (w = longest id in bytes) and the stable
    argsort of ``keys``, so ``keys[order]`` is sorted and equal ids keep row order."""
    width = int(pc.max(pc.binary_length(ids)).as_py() or 1) if len(ids) else 1
    keys = fixed_width_keys(ids, width)
    return keys, argsort_keys(keys)


def source_index_table(sorted_keys: np.ndarray, rows: np.ndarray) -> pa.Table:
    """The ``source_index.arrow`` table: ``key`` FixedSizeBinary(w) sorted, ``row_id`` int64."""
    sorted_keys = np.ascontiguousarray(sorted_keys)
    width = sorted_keys.dtype.itemsize
    key = pa.Array.from_buffers(pa.binary(width), len(sorted_keys), [None, pa.py_buffer(sorted_keys)])
    return pa.table({"key": key, "row_id": pa.array(np.asarray(rows, dtype=np.int64))})


def build_source_index(ids: pa.ChunkedArray | pa.Array) -> pa.Table:
    """Source index for rows ``0..len(ids)-1``; among duplicate ids the lowest row wins."""
    keys, order = sort_source_keys(ids)
    return source_index_table(keys[order], order)


class SourceIndex:
    """Source id -> row id over a memory-mapped sorted key array."""

    def __init__(self, table: pa.Table):
        key = table.column("key").combine_chunks()
        self.width = key.type.byte_width
        self._keys = np.frombuffer(key.buffers()[1], dtype=f"S{self.width}")[key.offset : key.offset + len(key)]
        self._rows = numpy_view(table.column("row_id"))

    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """``[len(ids)]`` int64 rows, -1 where the id is absent."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids) or not len(self._keys):
            return out
        encoded = [str(i).encode("utf-8") for i in ids]
        ok = np.array([0 < len(e) <= self.width and b"\0" not in e for e in encoded], dtype=bool)
        if not ok.any():
            return out
        query = np.array([e for e, good in zip(encoded, ok) if good], dtype=f"S{self.width}")
        pos = np.searchsorted(self._keys, query)
        pos_c = np.minimum(pos, len(self._keys) - 1)
        hit = self._keys[pos_c] == query
        out[np.flatnonzero(ok)] = np.where(hit, self._rows[pos_c], -1)
        return out
