"""The native kernels' build and switch (dist_nce/kernels/build.py): every kernel compiles with the
build's flags on any CPU with a compiler (running needs AVX512-BF16, compiling does not); a fresh
cache is built once under concurrent first uses; ``DIST_NCE_NATIVE`` takes auto or off; the
tests' summary builds nothing."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from dist_nce.kernels import attention as na
from dist_nce.kernels import build as native

KERNELS = sorted(src.stem for src in native.SOURCES.glob("*.c"))
ABI_SYMBOLS = {"block_lse": "dnce_block_abi", "attention_bf16": "dnce_attn_abi"}


def compiler_or_skip() -> None:
    try:
        native.compiler()
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_compiles_on_any_cpu(name, tmp_path, monkeypatch):
    compiler_or_skip()
    monkeypatch.setenv("DIST_NCE_NATIVE_CACHE", str(tmp_path))
    lib = native.compile_only(name)
    assert lib.parent == tmp_path and lib.name.startswith(f"{name}-")
    # loading runs none of the kernel's instructions: safe on a CPU without AVX512
    assert hasattr(ctypes.CDLL(str(lib)), ABI_SYMBOLS[name])


def test_fresh_cache_builds_once_under_concurrent_first_use(tmp_path):
    compiler_or_skip()
    env = {**os.environ, "DIST_NCE_NATIVE_CACHE": str(tmp_path)}
    code = "from dist_nce.kernels import build as native; print(native.compile_only('block_lse').name)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1 and files[0].startswith("block_lse-") and files[0].endswith(".so"), files
    assert all(o[0].strip() == files[0] for o in outs)


def test_the_switch_takes_auto_or_off(monkeypatch):
    monkeypatch.delenv(native.SWITCH, raising=False)
    auto = {"block": native.unavailable_reason(), "attention": na.unavailable_reason()}
    for value in ("", "auto", " Auto "):
        monkeypatch.setenv(native.SWITCH, value)
        assert {"block": native.unavailable_reason(), "attention": na.unavailable_reason()} == auto
    monkeypatch.setenv(native.SWITCH, " OFF")
    assert native.unavailable_reason() == na.unavailable_reason() == "DIST_NCE_NATIVE=off"
    monkeypatch.setenv(native.SWITCH, "0")
    with pytest.raises(ValueError, match="DIST_NCE_NATIVE must be auto or off; got '0'"):
        native.unavailable_reason()


def test_summaries_name_every_kernel_and_build_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(native.SWITCH, raising=False)
    monkeypatch.setenv("DIST_NCE_NATIVE_CACHE", str(tmp_path))
    for kernel in native.KERNELS.values():  # as in a session that never needed a kernel
        monkeypatch.setattr(kernel, "exercised", False)
        monkeypatch.setattr(kernel, "loaded", None)
    lacks = [f for f in native.REQUIRED_FLAGS if f not in native.cpu_flags()]
    cheap = f"not available: this CPU lacks {', '.join(lacks)}" if lacks else "not exercised"
    assert native.summaries() == dict.fromkeys(KERNELS, cheap)
    monkeypatch.setenv(native.SWITCH, "off")
    assert native.summaries() == dict.fromkeys(KERNELS, "not available: DIST_NCE_NATIVE=off")
    assert not os.listdir(tmp_path)
