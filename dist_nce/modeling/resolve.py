"""One way in for a model path: a dist-nce directory or a BLINK checkpoint file.

Every entry point that takes a retriever (encode_kb, evaluate_kilt_aida, link, the Serve
app) calls :func:`load_retriever`, and every one that takes a reranker calls
:func:`load_reranker`, so BLINK's released files work wherever a trained model does:

* a **directory** is what ``save_pretrained`` wrote (it has ``manifest.json``; its kind is
  checked by ``from_pretrained``) and brings its own tokenizer;
* a **regular file** is a BLINK checkpoint (``biencoder_wiki_large.bin``,
  ``crossencoder_wiki_large.bin``), read with ``torch.load(weights_only=True)``. The
  architecture is read off the weights (:func:`dist_nce.modeling.blink.bert_config_from_state`)
  unless a config names a model directory, and the tokenizer is ``tokenizer_dir`` or the
  default model's, which has bert-uncased's vocabulary.

Anything else (a missing path, a directory without ``manifest.json``, a device file) is
an error naming the path and the two accepted forms.
"""
from __future__ import annotations

import os
from pathlib import Path

from dist_nce.core.artifacts import MANIFEST
from dist_nce.modeling.blink import load_blink_retriever
from dist_nce.modeling.blink_crossencoder import load_blink_reranker
from dist_nce.modeling.reranker import Reranker, RerankerConfig
from dist_nce.modeling.retriever import Retriever, RetrieverConfig

RETRIEVER_FORMS = ("a dist-nce retriever directory (Retriever.save_pretrained, with manifest.json) or a BLINK "
                   "biencoder checkpoint file (biencoder_wiki_large.bin)")
RERANKER_FORMS = ("a dist-nce reranker directory (Reranker.save_pretrained, with manifest.json) or a BLINK "
                  "cross-encoder checkpoint file (crossencoder_wiki_large.bin)")


def is_checkpoint_file(path: str | os.PathLike, forms: str = RETRIEVER_FORMS) -> bool:
    """True for a regular file (a BLINK checkpoint), False for a saved dist-nce directory;
    FileNotFoundError / ValueError naming ``path`` and ``forms`` for anything else."""
    p = Path(path)
    if p.is_file():
        return True
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            raise FileNotFoundError(f"{p}: a directory without {MANIFEST}; expected {forms}")
        return False
    if not p.exists():
        raise FileNotFoundError(f"{p}: not found; expected {forms}")
    raise ValueError(f"{p}: neither a regular file nor a directory; expected {forms}")


def check_reranker(path: str | os.PathLike) -> None:
    """Raise what :func:`load_reranker` would for a path that holds no reranker, without building one: the
    directory's manifest kind, or the file's keys (a BLINK cross-encoder's; mapped, not read, where the file
    is zip-format). ``FileNotFoundError``, ``ValueError`` (``ArtifactMismatch``, ``BlinkCheckpointError``)."""
    from dist_nce.core.artifacts import read_manifest
    from dist_nce.modeling.blink import BlinkCheckpointError, load_state_file
    from dist_nce.modeling.blink_crossencoder import split_crossencoder_state
    from dist_nce.modeling.reranker import MANIFEST_KIND

    if not is_checkpoint_file(path, RERANKER_FORMS):
        read_manifest(path, MANIFEST_KIND)
        return
    try:
        state = load_state_file(path, mmap=True)
    except BlinkCheckpointError:  # torch's legacy format cannot be mapped: read it (its own error if not a state dict)
        state = load_state_file(path)
    split_crossencoder_state(state, os.fspath(path))


def load_retriever(
    path: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
    config: RetrieverConfig | None = None, num_attention_heads: int | None = None,
) -> Retriever:
    """The retriever at ``path``: a saved directory or a BLINK biencoder file (module docstring).

    For a BLINK file, ``config`` gives the preset (default dual, BLINK's own), m, storage
    dtype and, in ``mention_model``, an optional architecture directory; ``tokenizer_dir``
    the tokenizer. A directory brings both; a ``config`` given with it must agree on
    preset and m (``ArtifactMismatch`` otherwise), and ``tokenizer_dir`` is not used.
    """
    if is_checkpoint_file(path, RETRIEVER_FORMS):
        return load_blink_retriever(path, config or RetrieverConfig(), tokenizer_dir, num_attention_heads)
    expect = None if config is None else {"preset": config.preset, "m": config.m}
    return Retriever.from_pretrained(path, expect=expect)


def load_reranker(
    path: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
    config: RerankerConfig | None = None, num_attention_heads: int | None = None,
) -> Reranker:
    """The reranker at ``path``: a saved directory or a BLINK cross-encoder file (module docstring).

    For a BLINK file, ``config`` gives max_len, dropout and, in ``model``, an optional
    architecture directory (see :func:`~dist_nce.modeling.blink_crossencoder.load_blink_reranker`);
    a directory brings its own config and tokenizer (``config``, ``tokenizer_dir`` unused).
    """
    if is_checkpoint_file(path, RERANKER_FORMS):
        return load_blink_reranker(path, config, tokenizer_dir=tokenizer_dir,
                                   num_attention_heads=num_attention_heads)
    return Reranker.from_pretrained(path)
