"""The native kernels' build, switch and mask (dist_nce/kernels/build.py): every kernel compiles with
its instruction set's flags on any CPU with a compiler (running needs the flags, compiling does
not), and the AVX2 kernel holds no AVX512 instruction; a fresh cache is built once under
concurrent first uses; ``DIST_NCE_NATIVE`` takes auto or off; ``DIST_NCE_NATIVE_MASK`` hides flags
from every check; the tests' summary builds nothing."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys

import pytest

from dist_nce.kernels import attention as na
from dist_nce.kernels import build as native

KERNELS = sorted(src.stem for src in native.SOURCES.glob("*.c"))
ABI_SYMBOLS = {"block_lse": "dnce_block_abi", "attention_bf16": "dnce_attn_abi", "block_fp32": "dnce_fp32_abi",
               "noise": "dnce_noise_abi"}
# an AVX2 + FMA laptop's flags (no AVX512 at all)
AVX2_LAPTOP = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2".split())


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
    """Three processes ask for the same kernel at once: the compiler runs once (the others wait on
    the lock and load its library), and the cache holds one library and no temporary file."""
    compiler_or_skip()
    cache, log = tmp_path / "cache", tmp_path / "builds.log"
    cc = tmp_path / "cc"  # the real compiler, logging each build (not the --version the cache key reads)
    cc.write_text(f'#!/bin/sh\ncase "$1" in --version) ;; *) echo build >> {log} ;; esac\n'
                  f'exec {shutil.which(native.compiler())} "$@"\n')
    cc.chmod(0o755)
    env = {**os.environ, "DIST_NCE_NATIVE_CACHE": str(cache), "CC": str(cc)}
    code = "from dist_nce.kernels import build as native; print(native.compile_only('block_lse').name)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    libs = sorted(f for f in os.listdir(cache) if not f.endswith(".lock"))
    assert len(libs) == 1 and libs[0].startswith("block_lse-") and libs[0].endswith(".so"), libs
    assert all(o[0].strip() == libs[0] for o in outs)
    assert log.read_text().splitlines() == ["build"]


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
    def cheap(name: str) -> str:
        lacks = [f for f in native.ISAS[name].flags if f not in native.cpu_flags()]
        return f"not available: this CPU lacks {', '.join(lacks)}" if lacks else "not exercised"

    assert native.summaries() == {name: cheap(name) for name in KERNELS}
    monkeypatch.setenv(native.SWITCH, "off")
    assert native.summaries() == dict.fromkeys(KERNELS, "not available: DIST_NCE_NATIVE=off")
    assert not os.listdir(tmp_path)


def test_every_kernel_has_an_instruction_set():
    assert sorted(native.ISAS) == KERNELS
    for name, isa in native.ISAS.items():
        flags = " ".join(isa.cflags)
        assert ("-mavx512" in flags) == any(f.startswith("avx512") for f in isa.flags), name


def test_the_avx2_kernel_holds_no_avx512_instruction(tmp_path, monkeypatch):
    # built with -mavx2 -mfma -mno-avx512f, it runs on a CPU without AVX512: no zmm or mask
    # register, no EVEX-only ymm16-31 (objdump's AT&T spelling)
    compiler_or_skip()
    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    cflags = native.AVX2_FMA.cflags
    assert not [f for f in cflags if f.startswith("-mavx512")] and "-mno-avx512f" in cflags
    monkeypatch.setenv("DIST_NCE_NATIVE_CACHE", str(tmp_path))
    text = subprocess.run(["objdump", "-d", str(native.compile_only("block_fp32"))], capture_output=True, text=True,
                          check=True).stdout
    assert "vfmadd231ps" in text and "ymm" in text  # the disassembly is there
    assert not re.search(r"%zmm|%k[0-7]\b|%ymm(1[6-9]|2\d|3[01])\b|\{1to", text)


def test_the_mask_hides_flags_from_every_check(monkeypatch):
    monkeypatch.delenv(native.MASK, raising=False)
    monkeypatch.delenv(native.SWITCH, raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_LAPTOP)
    assert native.missing_flags("block_lse") == "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16"
    assert native.missing_flags("block_fp32") is None
    assert native.unavailable_reason() == native.missing_flags("block_lse")  # no build: the CPU check comes first
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_LAPTOP | set(native.REQUIRED_FLAGS))
    monkeypatch.setenv(native.MASK, "avx512_bf16")
    assert native.missing_flags("block_lse") == "DIST_NCE_NATIVE_MASK hides avx512_bf16"
    assert native.missing_flags("attention_bf16") == "DIST_NCE_NATIVE_MASK hides avx512_bf16"
    assert native.missing_flags("block_fp32") is None
    monkeypatch.setenv(native.MASK, " AVX2, fma ")  # as /proc/cpuinfo spells them, any case, comma or space
    assert native.missing_flags("block_fp32") == "DIST_NCE_NATIVE_MASK hides avx2, fma"
    assert native.BLOCK_FP32.unavailable_reason() == "DIST_NCE_NATIVE_MASK hides avx2, fma"
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_LAPTOP - {"fma"})
    assert native.missing_flags("block_fp32") == "this CPU lacks fma; DIST_NCE_NATIVE_MASK hides avx2"
    monkeypatch.setenv(native.SWITCH, "off")  # the switch still rules first
    assert native.BLOCK_FP32.unavailable_reason() == "DIST_NCE_NATIVE=off"
    monkeypatch.setenv(native.MASK, "avx2;rm")
    with pytest.raises(ValueError, match="DIST_NCE_NATIVE_MASK takes CPU flag names"):
        native.missing_flags("block_fp32")


# a Cascade Lake server's AVX512 (torch's own probe says bf16 there; oneDNN emulates it)
AVX512_NO_BF16 = AVX2_LAPTOP | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}


def test_bf16_units_need_avx512_bf16_or_amx(monkeypatch):
    monkeypatch.delenv(native.MASK, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for flags in (AVX2_LAPTOP, AVX512_NO_BF16):
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: flags)
        assert native.bf16_units_missing() == "this CPU lacks avx512_bf16 and amx_bf16"
    for flags in ({"avx512_bf16"}, {"amx_bf16"}, {"avx512_bf16", "amx_bf16"}):
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: AVX512_NO_BF16 | flags)
        assert native.bf16_units_missing() is None
    # the mask reproduces a CPU without them; hiding one of two leaves the other
    monkeypatch.setenv(native.MASK, "avx512_bf16")
    assert native.bf16_units_missing() is None
    monkeypatch.setenv(native.MASK, "avx512_bf16 amx_bf16")
    assert native.bf16_units_missing() == "DIST_NCE_NATIVE_MASK hides avx512_bf16, amx_bf16"
    monkeypatch.delenv(native.MASK)
    # oneDNN capped below its bf16 instructions emulates them whatever the CPU has
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert native.bf16_units_missing() == "ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps oneDNN below its bf16 instructions"
    for cap in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL", ""):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert native.bf16_units_missing() is None
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx2")  # the older name, read when the new one is unset
    assert native.bf16_units_missing() == "DNNL_MAX_CPU_ISA=AVX2 keeps oneDNN below its bf16 instructions"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # the new name wins
    assert native.bf16_units_missing() is None
