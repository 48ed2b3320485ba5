"""Hugging Face transformer -> token states ``[B, T, d]`` and a padding mask.

Both sides of a retriever, and the reranker, are plain ``AutoModel`` transformers
loaded from a local directory (no download). The retriever's embedding of a text is
read off the token states (BLINK: the ``[CLS]`` hidden state, no pooler, no extra
linear layer), so :class:`Encoder` returns the last hidden layer only.

The pooler of a BERT checkpoint is kept but frozen: it is never part of a retriever
score, yet keeping its weights means a saved encoder is a complete Hugging Face
checkpoint (``AutoModel.from_pretrained`` re-initialises nothing) and a BLINK export
carries the original ``pooler.*`` tensors that BLINK's strict ``load_state_dict``
needs. Frozen, it owns no trainable parameter without a gradient, which DDP and
DeepSpeed ZeRO would otherwise complain about.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import nn

from dist_nce.modeling import packed
from dist_nce.modeling.packed import attention_mask_4d


class TokenStates(NamedTuple):
    """``states`` [B, T, d] last-layer hidden states; ``mask`` [B, T] bool (True = real token)."""

    states: torch.Tensor
    mask: torch.Tensor


def load_transformer(model_dir: str | os.PathLike) -> nn.Module:
    """``AutoModel`` from a local directory, offline, with fp32 master weights.

    fp32 is explicit because transformers 5 may otherwise keep a checkpoint's storage
    dtype; mixed precision is applied by autocast at run time, not by the weights.
    """
    from transformers import AutoModel

    path = os.fspath(model_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: model directory not found (expected a Hugging Face model directory)")
    return AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def transformer_from_config(config: dict[str, Any]) -> nn.Module:
    """A randomly initialised ``AutoModel`` from a ``PretrainedConfig.to_dict()`` dict."""
    from transformers import AutoConfig, AutoModel

    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"transformer config has no 'model_type'; keys: {sorted(config)}")
    return AutoModel.from_config(AutoConfig.for_model(model_type, **config))


def trim_padding(ids: torch.Tensor, mask: torch.Tensor, min_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing columns that are padding in every row of the batch.

    ids, mask: [..., T] -> [..., T'] with T' = max(real length in the batch, min_len), T' <= T.
    Padding is right-aligned (BLINK convention), so real tokens never move. Attention
    masks make the real tokens' states independent of the padding, so this only saves
    work; ``min_len`` keeps columns that a score reads by position (the leftmost m).
    """
    if ids.shape != mask.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must have the same shape")
    real = mask.reshape(-1, mask.shape[-1]).any(0)
    nonzero = real.nonzero()
    length = int(nonzero[-1]) + 1 if nonzero.numel() else 0
    keep = min(mask.shape[-1], max(length, min_len))
    return ids[..., :keep], mask[..., :keep]


class Encoder(nn.Module):
    """Token states of a Hugging Face transformer.

    forward(ids [B, T] int, mask [B, T] bool/int) -> TokenStates(states [B, T, d], mask [B, T] bool).
    Inputs with extra leading dimensions ([B, K, T]) are flattened and restored.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.packing: str | None = None  # see use_packing
        pooler = getattr(model, "pooler", None)
        if pooler is not None:
            pooler.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "Encoder":
        return cls(load_transformer(model_dir))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Encoder":
        return cls(transformer_from_config(config))

    def use_packing(self, attention: str | None = "auto") -> None:
        """Run calls that give row ``lengths`` packed (``modeling.packed``): only the real tokens go
        through the transformer; ``attention`` is ``auto``, ``nested`` or ``padded`` (see there);
        None: always padded. Raises ValueError for a model that cannot be packed."""
        if attention is not None:
            packed.resolve_attention(attention, torch.device("cpu"))
            packed.enable(self.model)
        self.packing = attention

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def config_dict(self) -> dict[str, Any]:
        return self.model.config.to_dict()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                padded: bool | None = None, lengths: torch.Tensor | None = None) -> TokenStates:
        """``padded``: whether any token of ``mask`` is padding, when the caller knows it without reading
        the mask (the training loop knows its rows' lengths on the host). None: transformers looks
        (``padding_mask.all()`` to pick an unmasked kernel), which on a GPU waits for the device. False:
        no mask is made (the unmasked kernels). True: the mask is made for the model's attention
        implementation without that look (:func:`attention_mask_4d`).

        ``lengths`` [prod(...)] int64 on the host: each row's real tokens, which ``mask`` must hold as
        a run from position 0 (``packed.lengths_of``). With packing on (:meth:`use_packing`) only those
        tokens go through the transformer, and the states at padding are zeros; otherwise ignored."""
        if ids.shape != mask.shape:
            raise ValueError(f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must have the same shape")
        lead, t = ids.shape[:-1], ids.shape[-1]
        flat_mask = mask.reshape(-1, t).bool()
        if lengths is not None and self.packing is not None:
            plan = packed.plan(lengths, t, ids.device, self.packing)
            if plan.lengths.numel() != flat_mask.shape[0]:
                raise ValueError(f"lengths give {plan.lengths.numel()} rows, ids {tuple(ids.shape)} have "
                                 f"{flat_mask.shape[0]}")
            flat_types = None if token_type_ids is None else token_type_ids.reshape(-1, t)
            states = packed.unpack(packed.forward(self.model, ids.reshape(-1, t), plan, flat_types), plan)
            return TokenStates(states.reshape(*lead, t, states.shape[-1]), flat_mask.reshape(*lead, t))
        if padded is None:
            attention = flat_mask.long()
        else:
            attention = attention_mask_4d(self.model, flat_mask) if padded else None
        out = self.model(
            input_ids=ids.reshape(-1, t).long(),
            attention_mask=attention,
            token_type_ids=None if token_type_ids is None else token_type_ids.reshape(-1, t).long(),
        )
        states = out.last_hidden_state
        return TokenStates(states.reshape(*lead, t, states.shape[-1]), flat_mask.reshape(*lead, t))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Hugging Face format (safetensors + config.json), loadable by ``AutoModel.from_pretrained``."""
        self.model.save_pretrained(os.fspath(directory))
