"""Tiny checkpoints in BLINK's released layouts, for the tests of every entry point that takes one.

Hidden size 64 with one attention head, so the architecture is inferable from the weights
alone (heads = hidden / 64), as for bert-large's ``biencoder_wiki_large.bin``; the MiniLM
vocabulary (bert-uncased's), so stores prepared with the tiny model's tokenizer match.
"""
from __future__ import annotations

from pathlib import Path

import torch


def tiny_bert(seed: int, scale: float = 0.5):
    """A random BertModel (hidden 64, 2 layers, 1 head), weights spread by seeded noise so a
    random model's texts do not all map to nearly one vector."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                                 intermediate_size=96, max_position_embeddings=512)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def legacy_names(state: dict) -> dict:
    """pytorch-pretrained-bert's LayerNorm.gamma/beta, as old BLINK files may have."""
    return {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
            for k, v in state.items()}


def write_blink_biencoder(path: str | Path, seed: int = 0, legacy: bool = True) -> Path:
    """``biencoder_wiki_large.bin``'s layout: context_encoder.bert_model.* and cand_encoder.bert_model.*."""
    state = {}
    for side, offset in (("context_encoder", 0), ("cand_encoder", 1)):
        state.update({f"{side}.bert_model.{k}": v for k, v in tiny_bert(seed + offset).state_dict().items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(legacy_names(state) if legacy else state, path)
    return path


def write_blink_crossencoder(path: str | Path, seed: int = 0, legacy: bool = True) -> Path:
    """``crossencoder_wiki_large.bin``'s layout: encoder.bert_model.* + encoder.additional_linear.{weight,bias}."""
    bert = tiny_bert(seed)
    state = {f"encoder.bert_model.{k}": v for k, v in bert.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state["encoder.additional_linear.weight"] = torch.randn(1, 64, generator=gen)
    state["encoder.additional_linear.bias"] = torch.randn(1, generator=gen)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(legacy_names(state) if legacy else state, path)
    return path
