"""Counter-based Gumbel noise: G = F(seed, query key, row), a pure function of three integers.

The noise behind every exact hard-negative sample (``negatives``, ``block_gumbel``, the shards'
search): a shard owning rows [a, b) draws exactly the noise a flat search would, so merged
samples equal flat ones bit for bit (docs/design.md section 5).

On a CPU the integer half (the hash, and the uniform u it gives) runs in ``native/noise.c``
where a C compiler is (``DIST_NCE_NATIVE=off`` keeps it in torch); the logs are torch's on
both paths, so the noise has the same bits either way (tests/sampling/test_noise.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_nce.kernels import build as native

# splitmix64 (Steele, Lea, Flood 2014) constants, as signed int64 where they exceed 2**63.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
_ROW_SALT = 0x5851F42D4C957F2D
_TWO_M53 = 2.0 ** -53


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64 step: a bijection on 64-bit words; int64 multiplication wraps mod 2**64."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _mix_(x: Tensor, tmp: Tensor) -> Tensor:
    """:func:`_mix` in place (same bits), ``tmp`` a scratch tensor of x's shape: no allocations."""
    x.add_(_GOLDEN)
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(mul)
    return x


# Elements per noise block: the ~10 integer passes then stay in cache (2-3x faster on CPU).
_NOISE_BLOCK = 1 << 15


def gumbel_noise(seed: int, query_keys: Tensor, rows: Tensor, rows_first: bool = False) -> Tensor:
    """Standard Gumbel noise G[b, j] = F(seed, query_keys[b], rows[..., j]) as float64.

    Args:
        seed: any int64; the run's sampling seed (derive a new one per epoch or step).
        query_keys: [B] int64, one integer per query, e.g. the mention's index in the data set.
        rows: [n] (shared by all queries) or [B, n] int64 global entity rows.
        rows_first: return the shared-rows noise as [n, B] (the same values, transposed without
            a copy pass: what the native block kernels read, a block's noise for consecutive queries).
    Returns:
        [B, n] float64, -log(-log u) with u = (h >> 11 + 1/2) / 2**53 in (0, 1), h the
        splitmix64 hash of (seed, query key, row). Pure and device-agnostic integer math, and
        elementwise, so either layout holds the same bits.
    """
    if query_keys.dtype != torch.int64 or query_keys.dim() != 1:
        raise ValueError(f"gumbel_noise: query_keys must be int64 [B], got {query_keys.dtype} "
                         f"{list(query_keys.shape)}")
    if rows.dtype != torch.int64 or rows.dim() not in (1, 2):
        raise ValueError(f"gumbel_noise: rows must be int64 [n] or [B, n], got {rows.dtype} {list(rows.shape)}")
    q = _mix(_mix(torch.full_like(query_keys, int(seed))) ^ query_keys)[:, None]
    shared = rows.dim() == 1
    if rows_first and not shared:
        raise ValueError("gumbel_noise: rows_first needs rows shared by all queries ([n])")
    if rows.shape[-1] and not q.is_cuda and not rows.is_cuda and native.NOISE.unavailable_reason() is None:
        return _native_noise(q[:, 0].contiguous(), rows, rows_first)
    r = _mix(rows.to(query_keys.device) ^ _ROW_SALT)[None, :] if shared else rows.to(query_keys.device)
    n = r.shape[1]
    if rows_first:  # [n, B]: rows down, queries across (xor commutes: the same hashes)
        q, r = q.T, r.T
    out = torch.empty((n, q.shape[1]) if rows_first else (q.shape[0], n), dtype=torch.float64, device=q.device)
    # On a CPU, blocks that stay in cache; on a GPU one pass (each op is a kernel launch)
    step = max(1, n if q.is_cuda else _NOISE_BLOCK // max(q.numel(), 1))
    tmp = None
    for a in range(0, n, step):  # in place per block: the ~10 integer passes stay in cache
        if rows_first:
            h = torch.bitwise_xor(r[a:a + step], q)
        else:
            h = torch.bitwise_xor(q, r[:, a:a + step]) if shared else torch.bitwise_xor(r[:, a:a + step], _ROW_SALT)
        if tmp is None or tmp.shape != h.shape:
            tmp = torch.empty_like(h)
        if not shared:  # per-query rows: the row's own mix first, as _mix(rows ^ salt) ^ q
            _mix_(h, tmp).bitwise_xor_(q)
        _mix_(h, tmp).bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
        block = out[a:a + step] if rows_first else out[:, a:a + step]
        block.copy_(h)
        block.add_(0.5).mul_(_TWO_M53).log_().neg_().log_().neg_()
    return out


def _native_noise(q: Tensor, rows: Tensor, rows_first: bool) -> Tensor:
    """:func:`gumbel_noise` with the hash and the uniforms in ``native/noise.c``, the logs in torch
    (the same operations on the same uniforms: the same bits)."""
    shared = rows.dim() == 1
    rows = (_mix(rows ^ _ROW_SALT) if shared else rows).contiguous()  # shared rows: mixed once here
    n = rows.shape[-1]
    out = torch.empty((n, q.shape[0]) if rows_first else (q.shape[0], n), dtype=torch.float64)
    native.NOISE.library().dnce_uniforms(q.data_ptr(), q.shape[0], rows.data_ptr(), n, int(shared), int(rows_first),
                                         out.data_ptr())
    flat = out.view(-1)
    for a in range(0, flat.numel(), _NOISE_BLOCK):  # the logs a cache-sized block at a time
        flat[a:a + _NOISE_BLOCK].log_().neg_().log_().neg_()
    return out
