"""The shards' encoder attention on CPUs with AVX512-BF16 (``native/attention_bf16.c``).

Why: a KB refresh runs the entity encoder over every row, in bf16 on such CPUs. With
narrow heads (MiniLM: 32 wide) torch's CPU flash attention runs at ~50 GFLOP/s against a
~440 GFLOP/s bf16 GEMM here, and took 30% of an encode for 5% of its FLOPs. The kernel
does one (sequence, head) per pass from L1 with the softmax fused between the products;
it computes what bf16 flash attention computes (fp32 scores and sums, bf16 probabilities),
up to the order of the fp32 sums, so encodes agree with the sdpa path within bf16 rounding.

transformers sees it as the attention implementation ``"dist_nce_bf16"``
(``AttentionInterface``), with sdpa's boolean masks (``AttentionMaskInterface``);
:func:`use_native_attention` switches a model to it (``ServiceConfig.encode_attention``).
Any call the kernel does not cover -- ``DIST_NCE_NATIVE=off`` (``kernels/build.py``; read when
``torch.compile`` traces), not on the CPU, not bf16, autograd recording, dropout in training,
causal without a mask, cross-attention of other lengths, grouped heads, head widths not a
multiple of 16, float or per-head masks -- goes to transformers' sdpa, so a switched model
computes the same function everywhere, only slower.

:func:`attention` is a ``torch.library`` custom op, so ``torch.compile``
(``service.encode_compile``) keeps it in the graph.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from dist_nce.kernels import build as native

NAME = "dist_nce_bf16"
ABI = 1


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dnce_attention.restype = ctypes.c_int
    lib.dnce_attention.argtypes = [p, p, p, p, i64, i64, i64, i64, p, p, p, p, p, ctypes.c_float, i64, i64]


KERNEL = native.Kernel("attention_bf16", "dnce_attn_abi", ABI, _declare)


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (``DIST_NCE_NATIVE=off``, CPU features, compiler, build), or None."""
    return KERNEL.unavailable_reason()


@functools.lru_cache(maxsize=4)
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dist-nce-attention")


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"attention: q, k, v must be [B, H, W, D] of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"attention: {name} must be bf16 on the CPU with unit stride over D; got {t.dtype} "
                             f"on {t.device}, strides {t.stride()}")
    B, _, W, D = q.shape
    if D % 16:
        raise ValueError(f"attention: the head width must be a multiple of 16, got {D}")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != (B, W, W) or mask.stride(-1) != 1):
        raise ValueError(f"attention: mask must be bool [B, W, W] = {(B, W, W)} with unit stride over keys; got "
                         f"{mask.dtype} {tuple(mask.shape)}, strides {mask.stride()}")


@torch.library.custom_op("dist_nce::bf16_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    _check(q, k, v, mask)
    lib = KERNEL.library()
    B, H, W, D = q.shape
    out = torch.empty(B, W, H, D, dtype=torch.bfloat16)
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (q, k, v)]
    mstrides = (ctypes.c_int64 * 2)(*mask.stride()[:2]) if mask is not None else None
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, W, D, *strides,
            mask.data_ptr() if mask is not None else None, mstrides, float(scale))
    # ctypes drops the GIL: sequences split over torch's intra-op thread count
    parts = max(1, min(torch.get_num_threads(), B))
    cuts = [B * i // parts for i in range(parts + 1)]
    if parts == 1:
        codes = [lib.dnce_attention(*args, 0, B)]
    else:
        codes = list(_pool(parts).map(lambda i: lib.dnce_attention(*args, cuts[i], cuts[i + 1]), range(parts)))
    if any(codes):
        raise RuntimeError(f"native attention failed (codes {codes}) on q {tuple(q.shape)}")
    return out


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    B, H, W, D = q.shape
    return q.new_empty(B, W, H, D)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """softmax(scale q k^T, masked) v per sequence and head, by the native kernel.

    q, k, v: [B, H, W, D] bf16 on the CPU, any strides with unit stride over D; D % 16 == 0.
    mask: None, or bool broadcastable to [B, 1, W, W] (True = attend), as sdpa takes it; a
    row with no key to attend gets zeros. scale: default D**-0.5.
    Returns [B, W, H, D] bf16 contiguous (heads next to each other, as the output projection
    reads them).
    """
    B, _, W, D = q.shape
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError(f"attention: mask must be [B or 1, 1, W or 1, W], got {tuple(mask.shape)}")
        mask = mask.expand(B, 1, W, W)[:, 0]
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    return _attention_op(q, k, v, mask, D ** -0.5 if scale is None else float(scale))


def _fallback_reason(module: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                     dropout: float, is_causal: bool | None) -> str | None:
    if q.device.type != "cpu" or {q.dtype, k.dtype, v.dtype} != {torch.bfloat16}:
        return "not bf16 on the CPU"
    off = native.switched_off()  # a model switched before the switch went off keeps working
    if off is not None:
        return off
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "autograd is recording"
    if dropout and module.training:
        return "dropout in training"
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)  # as sdpa reads it
    if causal and mask is None and q.shape[2] > 1:
        return "causal without a mask"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return "a float or per-head mask"
    try:  # shapes and strides: what the op itself accepts (grouped heads, cross-attention, head width)
        _check(q, k, v, None)
    except ValueError as exc:
        return str(exc)
    return None


def hf_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                 **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: (output [B, W, H, D], no weights)."""
    if kwargs.get("position_bias") is None and kwargs.get("softcap") is None and \
            _fallback_reason(module, query, key, value, attention_mask, dropout, is_causal) is None:
        return attention(query, key, value, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


@functools.lru_cache(maxsize=1)
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, hf_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_native_attention(model: torch.nn.Module, required: bool = False) -> str | None:
    """Switch a transformers model (or a module holding one as ``.encoder.model``) to the
    kernel. Returns None when switched, else why not (kernel unavailable, or a model without
    transformers' attention interface); ``required`` raises instead."""
    hf = getattr(getattr(model, "encoder", None), "model", model)
    reason = unavailable_reason()
    if reason is None and not hasattr(hf, "set_attn_implementation"):
        reason = f"{type(hf).__name__} is not a transformers model"
    if reason is None:
        _register()
        try:
            hf.set_attn_implementation(NAME)
        except (ValueError, ImportError) as exc:  # a model whose attention does not go through the interface
            reason = f"{type(hf).__name__} refuses attention {NAME!r}: {exc}"
    if reason is not None and required:
        raise native.NativeUnavailable(f"native attention unavailable: {reason}")
    return reason
