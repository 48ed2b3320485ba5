"""Packed (unpadded) transformer forward: only the real tokens of a batch go through the model.

A batch of rows [R, T] with lengths l_i (real tokens first, BLINK's right padding) becomes one
sequence of N = sum l_i tokens ([1, N]) with positions restarting at 0 in each row. Every part of a
BERT-style layer but attention works token by token (embeddings, projections, layer norms, the
feed-forward), so transformers' own modules run on [1, N] unchanged; attention is the one place that
must keep the rows apart, and it does so here, by the rows' cumulative lengths (``cu_seqlens``).

Why: the retriever's candidates are of many lengths, and a batch padded to its longest row pays the
linear layers -- nearly all of the FLOPs -- for every padding position. Packed, the work is the real
tokens' (MosaicBERT's and NVIDIA's unpadded BERT). How much that saves depends on the KB: 13% of the
positions at the synthetic KILT KB's lengths (``benchmarks/kb_lengths.py``), more where short texts
are common.

Attention over the packed rows (``Packing.attention``):
- ``nested``: sdpa over a nested jagged tensor of the rows: on CUDA in bf16/fp16 that is
  FlashAttention's variable-length kernel, no padding at all, dropout and autograd included.
  (On CPUs torch runs it row by row: correct but slow, so it is not the default there.)
- ``padded``: the rows' q, k, v are scattered into [R, H, L, D] (L = the longest row), the model's
  own attention implementation (sdpa, eager, or the native CPU kernel) runs with a key-padding mask,
  and the real rows are gathered back. Only attention pays for padding (a few % of a BERT's FLOPs at
  these lengths); the default on CPUs.

:func:`enable` switches a transformers model to a registered attention implementation
(``dist_nce_packed_<base>``) that does the above when a forward carries a :class:`Packing` and is
exactly the model's previous implementation (``<base>``) otherwise, so one model serves packed and
padded calls. The switch is not saved (``config.to_dict`` leaves the implementation out).

Everything a :class:`Packing` holds is built on the host from lengths the caller knows (the training
loop has them before the batch goes to the device), so the packed forward reads nothing back.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

PREFIX = "dist_nce_packed_"
ATTENTION = ("auto", "nested", "padded")


class Packing(NamedTuple):
    """How R rows of width T are packed into N tokens (all on the model's device but ``lengths``).

    lengths [R] int64 (host); token_index [N] int64: b * T + t of each real token in the flat
    [R * T] layout; positions [N] int64: t; pad_index [N] int64: b * L + t in the [R * L] layout
    of the ``padded`` attention; cu_seqlens [R + 1] int64: offsets of the rows in [N];
    key_mask [R, L] bool: real keys; max_len L and min_len (host ints); width T; attention:
    ``nested`` or ``padded`` (see the module docstring).
    """

    lengths: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor
    pad_index: torch.Tensor
    cu_seqlens: torch.Tensor
    key_mask: torch.Tensor
    max_len: int
    min_len: int
    width: int
    attention: str

    @property
    def tokens(self) -> int:
        return int(self.token_index.shape[0])


def lengths_of(mask: torch.Tensor) -> torch.Tensor | None:
    """mask [..., T] bool on the CPU -> lengths [prod(...)] int64, or None when some row is not a
    run of real tokens from position 0 (then rows cannot be packed by length alone)."""
    rows = mask.reshape(-1, mask.shape[-1])
    lengths = rows.sum(-1, dtype=torch.int64)
    prefix = torch.arange(rows.shape[-1])[None, :] < lengths[:, None]
    return lengths if bool((prefix == rows).all()) else None


def resolve_attention(attention: str, device: torch.device) -> str:
    """``auto`` -> ``nested`` on CUDA (FlashAttention varlen), ``padded`` elsewhere (torch runs nested
    sdpa row by row on CPUs: 2x the whole padded forward in a probe on MiniLM's shapes here)."""
    if attention not in ATTENTION:
        raise ValueError(f"packed attention must be one of {list(ATTENTION)}, got {attention!r}")
    if attention == "auto":
        return "nested" if device.type == "cuda" else "padded"
    return attention


def plan(lengths: torch.Tensor, width: int, device: torch.device | str, attention: str = "auto") -> Packing:
    """A :class:`Packing` of rows with ``lengths`` [R] (host ints, each in 1..width) into their real tokens.

    Built on the host and copied to ``device`` without waiting (pinned when it is a GPU)."""
    device = torch.device(device)
    if isinstance(lengths, torch.Tensor) and lengths.device.type != "cpu":
        raise ValueError(f"packing lengths must be on the host (the caller knows them); got {lengths.device}")
    # numpy, not torch: host arithmetic that a profiler of the step would count as device reads
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        raise ValueError("packing: no rows")
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 1 or hi > width:
        raise ValueError(f"packing: row lengths must be in 1..{width} (the batch width); got {lo}..{hi}")
    rows = np.repeat(np.arange(lens.size), lens)
    starts = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    positions = np.arange(rows.size) - starts[:-1][rows]
    key_mask = np.arange(hi)[None, :] < lens[:, None]
    host = [torch.from_numpy(a) for a in (rows * width + positions, positions, rows * hi + positions, starts,
                                           key_mask)]
    pin = device.type == "cuda"
    on = tuple((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in host)
    return Packing(torch.from_numpy(lens), *on, max_len=hi, min_len=lo, width=width,
                   attention=resolve_attention(attention, device))


def pack(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """x [R, T, ...] -> [N, ...]: the real tokens, row after row."""
    return x.reshape(-1, *x.shape[2:])[packing.token_index]


def unpack(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """x [N, ...] -> [R, T, ...] with zeros at the padding."""
    rows = packing.lengths.numel()
    out = x.new_zeros(rows * packing.width, *x.shape[1:])
    return out.index_copy(0, packing.token_index, x).reshape(rows, packing.width, *x.shape[1:])


def _nested(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, dropout: float,
            scaling: float | None) -> torch.Tensor:
    """q, k, v [N, H, D] -> [N, H, D] by sdpa over nested jagged rows."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        # min/max given so that torch does not read them back from the offsets
        return torch.nested.nested_tensor_from_jagged(t, packing.cu_seqlens, min_seqlen=packing.min_len,
                                                      max_seqlen=packing.max_len).transpose(1, 2)

    out = nn.functional.scaled_dot_product_attention(rows(q), rows(k), rows(v), dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).values()


def _padded(module: nn.Module, base: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
            mask: torch.Tensor | None, dropout: float, scaling: float | None, **kwargs: Any) -> torch.Tensor:
    """q, k, v [N, H, D] -> [N, H, D] by the base implementation over the rows padded to L."""
    rows, length = packing.lengths.numel(), packing.max_len

    def pad(t: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [R, H, L, D]
        out = t.new_zeros(rows * length, *t.shape[1:]).index_copy(0, packing.pad_index, t)
        return out.reshape(rows, length, *t.shape[1:]).transpose(1, 2)

    out, _ = _base_attention(base)(module, pad(q), pad(k), pad(v), mask, dropout=dropout, scaling=scaling,
                                   **kwargs)
    return out.reshape(rows * length, *out.shape[2:])[packing.pad_index]  # out: [R, L, H, D]


@functools.lru_cache(maxsize=None)  # called in every layer's attention: look the function up once per name
def _base_attention(base: str):
    """transformers' attention function of implementation ``base`` (eager's is not in its registry)."""
    if base == "eager":
        from transformers.models.bert.modeling_bert import eager_attention_forward

        return eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     *, base: str, dist_nce_packing: Packing | None = None,
                     dist_nce_pad_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. Packed call: query, key, value [1, H, N, D] ->
    ([1, N, H, D], None); any other call goes to the ``base`` implementation unchanged."""
    if dist_nce_packing is None:
        return _base_attention(base)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    if query.shape[0] != 1 or query.shape[2] != dist_nce_packing.tokens:
        raise ValueError(f"packed attention: expected query [1, H, {dist_nce_packing.tokens}, D], got "
                         f"{tuple(query.shape)}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    if dist_nce_packing.attention == "nested":
        out = _nested(q, k, v, dist_nce_packing, dropout, scaling)
    else:
        kwargs.pop("is_causal", None)
        out = _padded(module, base, q, k, v, dist_nce_packing, dist_nce_pad_mask, dropout, scaling,
                      is_causal=False, **kwargs)
    return out[None], None


def _register(base: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    name = PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, functools.partial(packed_attention, base=base))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base, sdpa_mask)
        AttentionMaskInterface.register(name, mask_fn)
    return name


def base_implementation(model: nn.Module) -> str:
    """The attention implementation a (possibly switched) transformers model runs for padded calls."""
    name = str(model.config._attn_implementation)
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def enable(model: nn.Module) -> None:
    """Switch a transformers model to the packed implementation over its current one (idempotent).

    Raises ValueError for a model whose attention does not go through transformers' interface."""
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} is not a transformers model; it cannot be packed")
    if getattr(model.config, "is_decoder", False):
        raise ValueError(f"{type(model).__name__} is a decoder; packing is for bidirectional encoders")
    base = base_implementation(model)
    if base.startswith("flash") or "/" in base:
        raise ValueError(f"{type(model).__name__} runs attention {base!r}; pack over sdpa, eager or dist_nce_bf16")
    model.set_attn_implementation(_register(base))


def attention_mask_4d(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """mask [B, T] bool -> the 4D attention mask ``model``'s attention implementation takes (bool
    [B, 1, T, T] for sdpa, additive float for eager), made by transformers' own function but with
    its shortcut off: that shortcut drops the mask when no token is padding, and finding out reads
    the mask back (a host-device synchronisation per forward on a GPU). A 4D mask is passed to the
    model as it is."""
    from transformers.masking_utils import create_bidirectional_mask

    # What the mask function reads of the embeddings: batch, length, dtype (eager's additive mask), device.
    probe = torch.empty(mask.shape[0], mask.shape[1], 0, dtype=model.get_input_embeddings().weight.dtype,
                        device=mask.device)
    return create_bidirectional_mask(config=model.config, inputs_embeds=probe, attention_mask=mask,
                                     allow_is_bidirectional_skip=False)


def forward(model: nn.Module, ids: torch.Tensor, packing: Packing,
            token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ids [R, T] (and token types) -> last hidden states [N, d] of the real tokens, by a model
    switched with :func:`enable`; equal to the padded forward's states at those tokens up to rounding."""
    if not str(model.config._attn_implementation).startswith(PREFIX):
        raise ValueError("packed forward: the model is not switched to packed attention (packed.enable)")
    if ids.dim() != 2 or ids.shape[0] != packing.lengths.numel() or ids.shape[1] != packing.width:
        raise ValueError(f"packed forward: ids must be [{packing.lengths.numel()}, {packing.width}] as planned, "
                         f"got {tuple(ids.shape)}")
    extra: dict[str, Any] = {}
    if packing.attention == "padded":
        # made once per forward in the base implementation's format (every layer uses it)
        extra["dist_nce_pad_mask"] = attention_mask_4d(model, packing.key_mask)
    types = None if token_type_ids is None else pack(token_type_ids.long(), packing)[None]
    out = model(input_ids=pack(ids.long(), packing)[None], position_ids=packing.positions[None],
                token_type_ids=types, attention_mask=None, dist_nce_packing=packing, **extra)
    return out.last_hidden_state[0]
