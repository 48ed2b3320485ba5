"""Counter-based Gumbel noise in one Triton launch: ``sampling.noise.gumbel_noise`` fused.

torch builds the splitmix64 hash from single integer operations, about 85 kernel launches for
one noise matrix; on a GPU each is a launch and a pass over [B, n] int64, which made the noise,
not the GEMM, the cost of a small exact search. Here one program hashes, converts and takes
the two logs for a tile of (query, row) pairs in registers.

The integers are the same as torch's (splitmix64 of (seed, query key, row), wrapping uint64
arithmetic), and so are u = ((h >> 11) + 1/2) 2^-53 and -log(-log u) in float64; the logs are
the device's (libdevice on CUDA, numpy in the interpreter), which may round the last bit
differently from torch's. Every shard and the flat search of the GPU path use this function
alike, so sharded == flat holds bit for bit; ``tests/sampling/test_block_fused.py`` checks it
against ``gumbel_noise``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_nce.kernels.triton_base import available, seed_hash, tl, triton

if triton is not None:
    from dist_nce.kernels.triton_base import gumbel_of, mix

    @triton.jit
    def _gumbel(keys_ptr, rows_ptr, stride_r, out_ptr, stride_o, seed_bits, batch, n,
                SHARED: tl.constexpr, QT: tl.constexpr, NT: tl.constexpr):
        qs = tl.program_id(0) * QT + tl.arange(0, QT)
        cols = tl.program_id(1) * NT + tl.arange(0, NT)
        live = (qs < batch)[:, None] & (cols < n)[None, :]
        key = tl.load(keys_ptr + qs, mask=qs < batch, other=0).to(tl.uint64, bitcast=True)
        q = mix(key ^ seed_bits.to(tl.int64).to(tl.uint64, bitcast=True))
        if SHARED:
            r = tl.load(rows_ptr + cols, mask=cols < n, other=0).to(tl.uint64, bitcast=True)[None, :]
        else:
            r = tl.load(rows_ptr + qs[:, None].to(tl.int64) * stride_r + cols[None, :], mask=live,
                        other=0).to(tl.uint64, bitcast=True)
        g = gumbel_of(q[:, None], r)
        tl.store(out_ptr + qs[:, None].to(tl.int64) * stride_o + cols[None, :], g, mask=live)


def gumbel_noise_fused(seed: int, query_keys: Tensor, rows: Tensor) -> Tensor:
    """``sampling.noise.gumbel_noise(seed, query_keys, rows)`` in one launch: [B, n] float64.

    query_keys: [B] int64; rows: [n] (shared) or [B, n] int64 global rows, on the keys' device.
    """
    why = available(query_keys.device)
    if why is not None:
        raise RuntimeError(f"gumbel_noise_fused: {why}")
    if query_keys.dtype != torch.int64 or query_keys.dim() != 1:
        raise ValueError(f"gumbel_noise_fused: query_keys must be int64 [B], got {query_keys.dtype} "
                         f"{list(query_keys.shape)}")
    if rows.dtype != torch.int64 or rows.dim() not in (1, 2):
        raise ValueError(f"gumbel_noise_fused: rows must be int64 [n] or [B, n], got {rows.dtype} "
                         f"{list(rows.shape)}")
    keys = query_keys.contiguous()
    rows = rows.to(keys.device).contiguous()
    batch, n = keys.shape[0], rows.shape[-1]
    out = torch.empty((batch, n), dtype=torch.float64, device=keys.device)
    if not batch or not n:
        return out
    if keys.device.type == "cuda":
        qt, nt = 16, 128
    else:  # the interpreter: few large programs
        qt, nt = min(1 << (batch - 1).bit_length(), 256), min(1 << (n - 1).bit_length(), 1024)
    grid = (-(-batch // qt), -(-n // nt))
    with torch.profiler.record_function("dist_nce::gumbel_noise"):
        _gumbel[grid](keys, rows, rows.stride(0) if rows.dim() == 2 else 0, out, out.stride(0), seed_hash(seed),
                      batch, n, SHARED=rows.dim() == 1, QT=qt, NT=nt, num_warps=4)
    return out
