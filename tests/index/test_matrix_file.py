"""index.matrix_file: rows of torch.save (zip and legacy) and .npy matrices, read in place."""
import pickle

import numpy as np
import pytest
import torch

from dist_nce.index.matrix_file import MatrixFileError, open_matrix, read_rows

LEGACY = {"_use_new_zipfile_serialization": False}


@pytest.fixture(scope="module")
def x():
    return torch.randn(37, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt,kwargs", [("torch-zip", {}), ("torch-legacy", LEGACY)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_save_rows_equal_torch_load(tmp_path, x, fmt, kwargs, dtype):
    path = tmp_path / "enc.t7"
    torch.save(x.to(dtype), path, **kwargs)
    m = open_matrix(path)
    assert (m.format, m.rows, m.dim, m.bfloat16) == (fmt, 37, 8, dtype == torch.bfloat16)
    want = torch.load(path, weights_only=True)
    for a, b in [(0, 37), (3, 20), (36, 37), (5, 5)]:
        got = torch.from_numpy(read_rows(m, a, b))
        got = got.view(torch.bfloat16) if m.bfloat16 else got
        assert torch.equal(got, want[a:b])


@pytest.mark.parametrize("kwargs", [{}, LEGACY])
def test_a_view_into_a_larger_storage_reads_its_own_rows(tmp_path, kwargs):
    big = torch.arange(100 * 8, dtype=torch.float32).reshape(100, 8)
    torch.save(big[50:60], tmp_path / "view.t7", **kwargs)  # torch.save keeps the whole storage
    m = open_matrix(tmp_path / "view.t7")
    assert m.rows == 10 and np.array_equal(read_rows(m, 0, 10), big[50:60].numpy())


def test_a_dict_holding_one_tensor_is_read(tmp_path, x):
    torch.save({"encodings": x}, tmp_path / "d.pt")
    assert np.array_equal(read_rows(open_matrix(tmp_path / "d.pt"), 0, 37), x.numpy())


def test_npy_and_read_into_a_given_buffer(tmp_path, x):
    np.save(tmp_path / "a.npy", x.numpy())
    m = open_matrix(tmp_path / "a.npy")
    out = np.zeros((4, 8), np.float32)
    with open(m.path, "rb", buffering=0) as f:
        assert read_rows(m, 10, 14, out, file=f) is out
    assert np.array_equal(out, x[10:14].numpy())
    with pytest.raises(ValueError, match="out must be"):
        read_rows(m, 0, 3, out)
    with pytest.raises(IndexError, match="outside"):
        read_rows(m, 30, 38)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_hostile_pickle_is_refused_without_running_it(tmp_path, capsys):
    path = tmp_path / "evil.t7"
    with open(path, "wb") as f:  # a legacy-format stream whose object is a call to a global
        for obj in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}):
            pickle.dump(obj, f, protocol=2)
        pickle.dump(_Evil(), f, protocol=2)
    # (a process that imported Ray pickles print as ray's safe_print: the global's name varies)
    with pytest.raises(MatrixFileError, match=r"refuses to load global \S+print \(only a tensor"):
        open_matrix(path)
    assert "pwned" not in capsys.readouterr().out


@pytest.mark.parametrize("case", ["3d", "two", "noncontig", "truncated", "zip-truncated", "text", "int"])
def test_bad_files_get_errors_naming_the_file(tmp_path, x, case):
    path = tmp_path / f"{case}.t7"
    if case == "3d":
        torch.save(x.reshape(37, 2, 4), path)
    elif case == "two":
        torch.save({"a": x, "b": x.clone()}, path)
    elif case == "noncontig":
        torch.save(torch.randn(8, 37).t(), path, **LEGACY)
    elif case == "truncated":
        torch.save(x, path, **LEGACY)
        path.write_bytes(path.read_bytes()[:-40])
    elif case == "zip-truncated":  # a copy cut short loses the zip's central directory
        torch.save(x, path)
        path.write_bytes(path.read_bytes()[:600])
    elif case == "text":
        path.write_text("not a matrix\n")
    else:
        np.save(tmp_path / "int.npy", np.zeros((3, 2), np.int32))
        path = tmp_path / "int.npy"
    with pytest.raises(MatrixFileError, match=str(path.name)):
        open_matrix(path)


def test_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.t7"):
        open_matrix(tmp_path / "nope.t7")
