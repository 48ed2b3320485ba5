"""The native kernels (``native/*.c``): compiled on first use, loaded with ctypes.

``block_lse.c`` is the block sampler's kernel (below); ``attention_bf16.c`` the shards'
encoder attention (``kernels/attention.py``), each a :class:`Kernel` built and loaded by :func:`build`.

Why C and not a torch op: the block sampler needs a bf16 GEMM whose fp32 scores never leave
the core (block max, sum of exp, keep-or-drop), and torch's CPU bf16 GEMM rounds its output
to bf16. The kernel needs AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids and later, AMD
Zen 4 and later) and a C compiler; where either is missing the torch path runs instead
(``IndexConfig.kernel``), which samples from the same law.

The shared library is built once per (source, compiler, CPU flags) into
``$DIST_NCE_NATIVE_CACHE`` (default ``~/.cache/dist_nce/native``), by writing a temporary
file and renaming it, so concurrent first uses in several Ray workers are safe. The flags
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
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCES = Path(__file__).with_name("native")
SOURCE = SOURCES / "block_lse.c"
ABI = 3
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
CFLAGS = ["-O3", "-funroll-loops", "-fPIC", "-shared", "-ffp-contract=off", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512dq", "-mavx512bf16"]
SWITCH = "DIST_NCE_NATIVE"


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


def compiler() -> str:
    """The C compiler the kernels are built with; raises :class:`NativeUnavailable` without one."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (set CC, or install gcc)")


def _missing_flags() -> str | None:
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def compile_only(name: str) -> Path:
    """Build ``native/<name>.c`` into the cache without loading it (raises :class:`NativeUnavailable`
    without a compiler or when the build fails). Needs no AVX512 CPU: the flags are explicit,
    so machines that cannot run a kernel still check that it compiles."""
    return _build(compiler(), SOURCES / f"{name}.c")


def _build(cc: str, source: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + repr((version, CFLAGS)).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
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
    missing = _missing_flags()
    if missing:
        return NativeUnavailable(missing)
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
    """One kernel of ``native/``: built and loaded on its first check, once per process (the CPU
    and compiler do not change while it runs); :data:`SWITCH` is read at every check."""

    def __init__(self, name: str, abi_symbol: str, abi: int, declare: Callable[[ctypes.CDLL], None]):
        self.name, self.abi_symbol, self.abi, self.declare = name, abi_symbol, abi, declare
        self.loaded: ctypes.CDLL | NativeUnavailable | None = None
        self.exercised = False  # some caller took the library (for the tests' summary)
        KERNELS[name] = self

    def _load(self) -> ctypes.CDLL | NativeUnavailable:
        if self.loaded is None:
            lib = build(self.name, self.abi_symbol, self.abi)
            if not isinstance(lib, NativeUnavailable):
                self.declare(lib)
            self.loaded = lib
        return self.loaded

    def unavailable_reason(self) -> str | None:
        """Why the kernel cannot run here (switch, CPU features, compiler, build), or None when it can."""
        off = switched_off()
        if off is not None:
            return off
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
        return _summary(str(self.loaded) if isinstance(self.loaded, NativeUnavailable) else None)


def _summary(reason: str | None) -> str:
    reason = reason or switched_off() or _missing_flags()
    return f"not available: {reason}" if reason else "not exercised"


def summaries() -> dict[str, str]:
    """:meth:`Kernel.summary` of every source in ``native/`` (one whose module was never imported
    was not exercised)."""
    return {src.stem: KERNELS[src.stem].summary() if src.stem in KERNELS else _summary(None)
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
