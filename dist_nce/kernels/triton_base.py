"""What the Triton kernels share: the import (and the interpreter switch where there is no GPU),
:func:`available`, and the splitmix64 hash of ``sampling.noise`` as a Triton function.

Triton compiles kernels for CUDA tensors. For CPU tensors (tests on machines without a GPU)
the same functions run in Triton's interpreter, so the logic the GPU runs is what ``make test``
checks; no Triton at all means the callers keep their torch path.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Without a GPU Triton can only interpret; the switch is read when triton.language is
    # imported (its own helpers, tl.max among them, are decorated then).
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:  # optional: the GPU path only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

_M64 = (1 << 64) - 1
# splitmix64 (Steele, Lea, Flood 2014) and the row salt of sampling/noise.py, unsigned
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
ROW_SALT = 0x5851F42D4C957F2D
BLOCK_COUNTER_BIT = 1 << 62  # sampling.block_gumbel's block stream


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str) -> str | None:
    """None when the Triton kernels can run on ``device`` here, else why not."""
    if triton is None:
        return "triton is not installed"
    if torch.device(device).type != "cuda" and not _interpreting():
        return "triton was imported before dist_nce could select its interpreter (CPU tensors)"
    return None


def seed_hash(seed: int) -> int:
    """splitmix64 of the seed (mod 2^64) as an int64 bit pattern: the per-call constant of the
    noise, computed on the host once instead of per element."""
    x = int(seed) & _M64
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * _MUL1) & _M64
    x = ((x ^ (x >> 27)) * _MUL2) & _M64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


if triton is not None:
    @triton.jit
    def mix(x):
        """splitmix64 step on uint64 (wrapping multiplication), as sampling.noise._mix."""
        x = x + 0x9E3779B97F4A7C15
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def gumbel_of(q, r):
        """-log(-log u) for hashed query keys q and raw rows r (uint64, broadcastable), u from the
        top 53 bits of mix(q ^ mix(r ^ salt)): sampling.noise.gumbel_noise elementwise."""
        h = mix(q ^ mix(r ^ 0x5851F42D4C957F2D))
        u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53
        return -tl.log(-tl.log(u))
