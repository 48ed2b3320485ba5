"""kb.arrow_view.numpy_view against pyarrow's own to_numpy (tests/kb/test_store.py: a store opens without pandas)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kb.arrow_view import arrow_indices, numpy_view


@pytest.mark.parametrize("typ", [pa.int8(), pa.uint16(), pa.int32(), pa.int64(), pa.uint64(), pa.float16(),
                                 pa.float32(), pa.float64()])
def test_equals_to_numpy_for_every_numeric_type_offset_and_chunking(typ):
    values = np.arange(-3, 17).astype(typ.to_pandas_dtype() if typ != pa.float16() else np.float16)
    if pa.types.is_unsigned_integer(typ):
        values = np.abs(values)
    arr = pa.array(values, type=typ)
    for column in (arr, arr.slice(5, 9), pa.chunked_array([arr.slice(2, 4)]),
                   pa.chunked_array([arr.slice(0, 3), arr.slice(7, 6)]), arr.slice(4, 0)):
        got = numpy_view(column)
        want = column.to_numpy() if isinstance(column, pa.ChunkedArray) else column.to_numpy(zero_copy_only=False)
        assert got.dtype == want.dtype and got.shape == want.shape, (typ, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable


def test_one_chunk_is_a_view_and_nulls_or_strings_are_converted():
    arr = pa.array(np.arange(10, dtype=np.int32)).slice(3, 5)
    view = numpy_view(pa.chunked_array([arr]))
    assert not view.flags.owndata and view.tolist() == [3, 4, 5, 6, 7]
    with_null = numpy_view(pa.array([1, None, 3], type=pa.int64()))
    assert with_null.dtype == np.float64 and np.isnan(with_null[1]) and with_null[2] == 3
    assert numpy_view(pa.array(["a", "b"])).tolist() == ["a", "b"]
    assert numpy_view(pa.chunked_array([], type=pa.int32())).dtype == np.int32


def test_arrow_indices_take_like_pa_array():
    col = pa.array([f"t{i}" for i in range(20)])
    for idx in (np.array([3, 0, 19, 3]), np.arange(20, dtype=np.int32)[::-3], np.zeros(0, np.int64)):
        assert col.take(arrow_indices(idx)).to_pylist() == col.take(pa.array(idx)).to_pylist()
