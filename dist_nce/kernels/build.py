"""The native kernels (``native/*.c``): compiled on first use, loaded with ctypes.

``block_lse.c`` is the block sampler's kernel (below); ``attention_bf16.c`` the shards'
encoder attention (``index/attention.py``), built and loaded by the same :func:`build`.

Why C and not a torch op: the block sampler needs a bf16 GEMM whose fp32 scores never leave
the core (block max, sum of exp, keep-or-drop), and torch's CPU bf16 GEMM rounds its output
to bf16. The kernel needs AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids and later, AMD
Zen 4 and later) and a C compiler; where either is missing the torch path runs instead
(``IndexConfig.kernel``), which samples from the same law.

The shared library is built once per (source, compiler, CPU flags) into
``$DIST_NCE_NATIVE_CACHE`` (default ``~/.cache/dist_nce/native``), by writing a temporary
file and renaming it, so concurrent first uses in several Ray workers are safe. The flags
are explicit (no ``-march=native``), so one build runs on every CPU with these features.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


SOURCES = Path(__file__).with_name("native")
SOURCE = SOURCES / "block_lse.c"
ABI = 3
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
CFLAGS = ["-O3", "-funroll-loops", "-fPIC", "-shared", "-ffp-contract=off", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512bf16"]


class NativeUnavailable(RuntimeError):
    """The kernel cannot run here (CPU features, compiler or build); the message says which."""


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cache_dir() -> Path:
    return Path(os.environ.get("DIST_NCE_NATIVE_CACHE") or Path.home() / ".cache" / "dist_nce" / "native")


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (set CC, or install gcc)")


def _build(compiler: str, source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + repr((version, CFLAGS)).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode:
            raise NativeUnavailable(f"{compiler} could not build {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build(name: str, abi_symbol: str, abi: int) -> ctypes.CDLL | NativeUnavailable:
    """Load kernel ``native/<name>.c``, building it first if needed; the reason it cannot run
    instead (CPU features, compiler, build, or an ABI other than ``abi``, read from the
    library's ``abi_symbol()``), returned rather than raised so callers can cache it."""
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return NativeUnavailable(f"this CPU lacks {', '.join(missing)}")
    try:
        lib = ctypes.CDLL(str(_build(_compiler(), SOURCES / f"{name}.c")))
    except (NativeUnavailable, OSError) as exc:
        return exc if isinstance(exc, NativeUnavailable) else NativeUnavailable(f"loading {name}: {exc}")
    got = getattr(lib, abi_symbol)()
    if got != abi:
        return NativeUnavailable(f"{name} ABI {got} != {abi}")
    return lib


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | NativeUnavailable:
    lib = build("block_lse", "dnce_block_abi", ABI)
    if isinstance(lib, NativeUnavailable):
        return lib
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dnce_block_topk.restype = ctypes.c_int
    lib.dnce_block_topk.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, i64, p, p, p, i64, p, i64, i64,
                                    p, p, p, p, p, p, p, p, p, p, p]
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernel; raises :class:`NativeUnavailable` (with the reason) when it cannot run."""
    lib = _load()
    if isinstance(lib, NativeUnavailable):
        raise lib
    return lib


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine (CPU features, compiler, build), or None when it can."""
    lib = _load()
    return str(lib) if isinstance(lib, NativeUnavailable) else None


def available() -> bool:
    """True when the kernel runs on this machine."""
    return unavailable_reason() is None


def tile_queries() -> int:
    """Queries per tile of the kernel (the query count is padded to a multiple of it)."""
    return int(library().dnce_block_qt())


def rows_per_microtile() -> int:
    """``block_rows`` must be a multiple of this for the kernel."""
    return int(library().dnce_block_er())
