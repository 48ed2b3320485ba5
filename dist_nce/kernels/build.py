"""The native kernels (``native/*.c``): compiled on first use, loaded with ctypes.

``block_lse.c`` (AVX512-BF16) and ``block_fp32.c`` (AVX2 + FMA) are the exact search's kernels
(block sampler and top-k, ``sampling/block_native.py``); ``noise.c`` the integer half of the
Gumbel noise (``sampling/noise.py``); ``attention_bf16.c`` the shards' encoder attention
(``kernels/attention.py``), each a :class:`Kernel` built and loaded by :func:`build`.

Why C and not a torch op: the exact search needs a GEMM whose fp32 scores never leave the
core (block max, sum of exp, keep-or-drop); torch writes every score chunk out and reads it
back in several passes, which cost more than the GEMM, and its CPU bf16 GEMM rounds its
output to bf16. ``block_lse.c`` needs AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids and
later, AMD Zen 4 and later), ``block_fp32.c`` AVX2 and FMA (Intel Haswell, AMD Zen 1 and
later: the CPUs people have), each a C compiler; where neither runs the torch path does
(``IndexConfig.kernel``), which samples from the same law. Each kernel is compiled with its
own instruction set only (:data:`ISAS`): ``block_fp32.c`` with ``-mno-avx512f``, so it runs on
a CPU without AVX512.

The shared library is built once per (source, compiler, CPU flags) into
``$DIST_NCE_NATIVE_CACHE`` (default ``~/.cache/dist_nce/native``), by writing a temporary
file and renaming it, so concurrent first uses in several Ray workers are safe, and under a
lock beside it, so they build it once: the others wait for that build (a fresh node's shards
and Train workers start together; each compiled every kernel, about 0.7 CPU-s apiece). The flags
are explicit (no ``-march=native``), so one build runs on every CPU with these features.

``$DIST_NCE_NATIVE`` switches every kernel of ``native/``: ``auto`` (the default, also when
unset or empty) uses a kernel where the CPU and a compiler allow; ``off`` makes every
availability check answer "unavailable: DIST_NCE_NATIVE=off", so each caller takes the path
it takes on a CPU without the kernel (its ``auto`` setting falls back, a ``native`` setting
raises). It is read at every check, not once per process, so tests can exercise the fallback
paths on any CPU and an operator can rule the kernels out without touching configs (in the
environment the Ray workers start with: each process reads its own); any other value raises.
``auto`` leaves the per-setting choices (``IndexConfig.kernel``, ``ServiceConfig.encode_attention``)
as they are.

``$DIST_NCE_NATIVE_MASK`` names CPU flags (comma- or space-separated, as /proc/cpuinfo spells
them) that every kernel check treats as absent, read at every check like the switch:
``avx512_bf16`` makes this machine choose what a CPU without AVX512-BF16 chooses (the AVX2
kernel), ``avx2`` what one without AVX2 chooses (torch). It serves to reproduce another CPU's
path on one machine (the tests, ``benchmarks/mining.py``'s AVX2 row) and to keep a mixed
fleet on one kernel; it can only take kernels away, never enable one the CPU lacks. The shards'
``encode_dtype: auto`` reads it too (:func:`bf16_units_missing`): hiding avx512_bf16 and amx_bf16
makes them encode in fp32, as on a CPU without bf16 units.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

SOURCES = Path(__file__).with_name("native")
SOURCE = SOURCES / "block_lse.c"
ABI = 4
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
_COMMON = ["-O3", "-funroll-loops", "-fPIC", "-shared", "-ffp-contract=off"]
CFLAGS = [*_COMMON, "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
SWITCH = "DIST_NCE_NATIVE"
MASK = "DIST_NCE_NATIVE_MASK"


class Isa(NamedTuple):
    """What a kernel is built for: the /proc/cpuinfo flags it needs and the compiler flags that
    enable exactly those instructions (explicit, never ``-march=native``)."""

    name: str
    flags: tuple[str, ...]
    cflags: tuple[str, ...]


AVX512_BF16 = Isa("AVX512-BF16", REQUIRED_FLAGS, tuple(CFLAGS))
# -mno-avx512f: no AVX512 instruction even where the compiler's default target has some
AVX2_FMA = Isa("AVX2+FMA", ("avx2", "fma"), (*_COMMON, "-mavx2", "-mfma", "-mno-avx512f"))
PORTABLE = Isa("portable C", (), tuple(_COMMON))
ISAS = {"block_lse": AVX512_BF16, "attention_bf16": AVX512_BF16, "block_fp32": AVX2_FMA, "noise": PORTABLE}


class NativeUnavailable(RuntimeError):
    """The kernel cannot run here (switch, CPU features, compiler or build); the message says which."""


def switched_off() -> str | None:
    """``"DIST_NCE_NATIVE=off"`` when the switch rules every kernel out, None under ``auto``."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value != "off":
        raise ValueError(f"{SWITCH} must be auto or off; got {value!r}")
    return f"{SWITCH}=off"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none); read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def masked_flags() -> frozenset[str]:
    """The flags ``$DIST_NCE_NATIVE_MASK`` hides from the kernel checks (read at every call)."""
    names = [f for f in re.split(r"[,\s]+", os.environ.get(MASK, "").strip().lower()) if f]
    bad = [f for f in names if not re.fullmatch(r"[a-z0-9_]+", f)]
    if bad:
        raise ValueError(f"{MASK} takes CPU flag names as /proc/cpuinfo spells them (e.g. avx512_bf16); got {bad}")
    return frozenset(names)


def missing_flags(name: str) -> str | None:
    """Why kernel ``name``'s instruction set is not usable here (flags the CPU lacks or the mask
    hides), or None."""
    need, have, hidden = ISAS[name].flags, cpu_flags(), masked_flags()
    lacks = [f for f in need if f not in have]
    masked = [f for f in need if f in have and f in hidden]
    why = ([f"this CPU lacks {', '.join(lacks)}"] if lacks else []) + (
        [f"{MASK} hides {', '.join(masked)}"] if masked else [])
    return "; ".join(why) or None


# oneDNN ISAs (``$ONEDNN_MAX_CPU_ISA`` or ``$DNNL_MAX_CPU_ISA``, lower case) below avx512_core_bf16: capped at one of these,
# oneDNN converts bf16 to fp32 in software even on a CPU with bf16 units
_ONEDNN_BELOW_BF16 = frozenset({"sse41", "avx", "avx2", "avx2_vnni", "avx512_core", "avx512_core_vnni"})
BF16_UNIT_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_units_missing() -> str | None:
    """Why torch's CPU bf16 GEMMs would be emulated here, or None where the CPU has bf16 units.

    torch's own probe (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) answers yes on every
    AVX512BW/VL/DQ CPU, also Skylake-to-Ice-Lake servers without AVX512-BF16, where oneDNN converts
    bf16 in software: a bf16 autocast GEMM measured 4.0x the fp32 one on this machine with oneDNN
    capped at ``AVX512_CORE`` (0.18x uncapped). So bf16 counts as fast only with AVX512-BF16 or
    AMX-BF16 visible (``$DIST_NCE_NATIVE_MASK`` hides them as it does from the kernels) and oneDNN
    not capped below them.
    """
    have, hidden = cpu_flags(), masked_flags()
    if not any(f in have for f in BF16_UNIT_FLAGS):
        return f"this CPU lacks {' and '.join(BF16_UNIT_FLAGS)}"
    if all(f in hidden or f not in have for f in BF16_UNIT_FLAGS):
        return f"{MASK} hides {', '.join(f for f in BF16_UNIT_FLAGS if f in have)}"
    # oneDNN reads ONEDNN_MAX_CPU_ISA, else its older name DNNL_MAX_CPU_ISA
    var = next((v for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(v, "").strip()), None)
    cap = os.environ[var].strip().lower() if var else ""
    if cap in _ONEDNN_BELOW_BF16:
        return f"{var}={cap.upper()} keeps oneDNN below its bf16 instructions"
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("DIST_NCE_NATIVE_CACHE") or Path.home() / ".cache" / "dist_nce" / "native")


def compiler() -> str:
    """The C compiler the kernels are built with; raises :class:`NativeUnavailable` without one."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (set CC, or install gcc)")


def compile_only(name: str) -> Path:
    """Build ``native/<name>.c`` into the cache without loading it (raises :class:`NativeUnavailable`
    without a compiler or when the build fails). Needs no AVX512 CPU: the flags are explicit,
    so machines that cannot run a kernel still check that it compiles."""
    return _build(compiler(), SOURCES / f"{name}.c")


def _build(cc: str, source: Path) -> Path:
    cflags = list(ISAS[source.stem].cflags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + repr((version, cflags)).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if out.exists():  # built by the process this one waited for
            return out
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *cflags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
            if proc.returncode:
                raise NativeUnavailable(f"{cc} could not build {source.name}: {proc.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def build(name: str, abi_symbol: str, abi: int) -> ctypes.CDLL | NativeUnavailable:
    """Load kernel ``native/<name>.c``, building it first if needed; the reason it cannot run
    instead (CPU features, compiler, build, or an ABI other than ``abi``, read from the
    library's ``abi_symbol()``), returned rather than raised so callers can cache it."""
    missing = missing_flags(name)
    if missing:
        return NativeUnavailable(missing)
    return _load(name, abi_symbol, abi)


def _load(name: str, abi_symbol: str, abi: int) -> ctypes.CDLL | NativeUnavailable:
    """:func:`build` without the CPU check (loading runs none of the kernel's instructions)."""
    try:
        lib = ctypes.CDLL(str(_build(compiler(), SOURCES / f"{name}.c")))
    except (NativeUnavailable, OSError) as exc:
        return exc if isinstance(exc, NativeUnavailable) else NativeUnavailable(f"loading {name}: {exc}")
    got = getattr(lib, abi_symbol)()
    if got != abi:
        return NativeUnavailable(f"{name} ABI {got} != {abi}")
    return lib


KERNELS: dict[str, Kernel] = {}


class Kernel:
    """One kernel of ``native/``: built and loaded on its first check that the CPU passes, once per
    process (the CPU and compiler do not change while it runs); :data:`SWITCH` and :data:`MASK`
    are read at every check."""

    def __init__(self, name: str, abi_symbol: str, abi: int, declare: Callable[[ctypes.CDLL], None]):
        self.name, self.abi_symbol, self.abi, self.declare = name, abi_symbol, abi, declare
        self.isa = ISAS[name]
        self.loaded: ctypes.CDLL | NativeUnavailable | None = None
        self.exercised = False  # some caller took the library (for the tests' summary)
        KERNELS[name] = self

    def _load(self) -> ctypes.CDLL | NativeUnavailable:
        if self.loaded is None:
            lib = _load(self.name, self.abi_symbol, self.abi)
            if not isinstance(lib, NativeUnavailable):
                self.declare(lib)
            self.loaded = lib
        return self.loaded

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot run here (switch, CPU features or mask, compiler, build), or None
        when it can."""
        why = switched_off() or missing_flags(self.name)
        if why is not None:
            return why
        lib = self._load()
        return str(lib) if isinstance(lib, NativeUnavailable) else None

    def library(self) -> ctypes.CDLL:
        """The loaded kernel; raises :class:`NativeUnavailable` (with the reason) when it cannot run."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise NativeUnavailable(f"native kernel {self.name} unavailable: {reason}")
        self.exercised = True
        return self.loaded

    def summary(self) -> str:
        """'exercised', 'not available: <reason>' or 'not exercised', from what this process already
        knows: it builds nothing, so a kernel never checked gets only the cheap reasons."""
        if self.exercised:
            return "exercised"
        return _summary(self.name, str(self.loaded) if isinstance(self.loaded, NativeUnavailable) else None)


def _summary(name: str, reason: str | None) -> str:
    reason = reason or switched_off() or missing_flags(name)
    return f"not available: {reason}" if reason else "not exercised"


def summaries() -> dict[str, str]:
    """:meth:`Kernel.summary` of every source in ``native/`` (one whose module was never imported
    was not exercised)."""
    return {src.stem: KERNELS[src.stem].summary() if src.stem in KERNELS else _summary(src.stem, None)
            for src in sorted(SOURCES.glob("*.c"))}


def _declare_block(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dnce_block_topk.restype = ctypes.c_int
    lib.dnce_block_topk.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, i64, p, p, p, i64, p, i64, i64,
                                    p, p, p, p, p, p, p, p, p, p, p]


BLOCK = Kernel("block_lse", "dnce_block_abi", ABI, _declare_block)


def library() -> ctypes.CDLL:
    """The loaded block kernel; raises :class:`NativeUnavailable` (with the reason) when it cannot run."""
    return BLOCK.library()


def unavailable_reason() -> str | None:
    """Why the block kernel cannot run here (switch, CPU features, compiler, build), or None when it can."""
    return BLOCK.unavailable_reason()


def available() -> bool:
    """True when the block kernel runs here."""
    return unavailable_reason() is None


def tile_queries() -> int:
    """Queries per tile of the kernel (the query count is padded to a multiple of it)."""
    return int(library().dnce_block_qt())


def rows_per_microtile() -> int:
    """``block_rows`` must be a multiple of this for the kernel."""
    return int(library().dnce_block_er())


def _declare_fp32(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dnce_fp32_block_topk.restype = ctypes.c_int
    lib.dnce_fp32_block_topk.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, i64, p, i64, p, p, p, i64, p, i64,
                                         i64, p, p, p, p, p, p, p, p, p, p, p, p, p]


# block_lse.c's contract on AVX2 + FMA (fp32 or bf16 rows, fp32 queries): sampling/block_native.py
BLOCK_FP32 = Kernel("block_fp32", "dnce_fp32_abi", 1, _declare_fp32)


def _declare_noise(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dnce_uniforms.restype = None
    lib.dnce_uniforms.argtypes = [p, i64, p, i64, i64, i64, p]


# the uniforms of sampling/noise.py's Gumbel noise (its logs stay torch's)
NOISE = Kernel("noise", "dnce_noise_abi", 1, _declare_noise)
