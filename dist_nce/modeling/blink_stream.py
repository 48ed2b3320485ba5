"""A BLINK biencoder's entity encoder state, read from the file one tensor at a time.

``jobs/import_encodings.py`` needs only the fingerprint of the entity encoder the encodings
came from (``dist_nce.index.encode.state_fingerprint`` of ``EntityEncoder.state()``), not
a model that runs. Building the retriever to get it holds both BERT-large towers in fp32
on top of the loaded file: 5,661 MiB at the peak for a 2.68 GB ``biencoder_wiki_large.bin``.

:func:`blink_entity_state` gives the same state without holding either tower:

* ``torch.load(mmap=True, weights_only=True)`` maps the file instead of reading it;
* the keys are checked exactly as the full load checks them (``split_blink_state``, then
  every name and shape of both towers against a model built on the meta device, which
  allocates nothing), so a file the full load refuses is refused here by the same message;
* the state's config is that meta model's, and its ``weights`` a mapping that copies one
  entity tensor out of the mapping when asked (cast to the model's dtype, as loading it
  into the model would) and then drops that tensor's pages of the mapping: mapped pages
  count in the process's resident set until they are unmapped, and the mapping lives as
  long as any tensor of the file.

``state_fingerprint`` reads the weights once each, in name order, so at most a tensor or
two (the 125 MB word embeddings) are resident at a time. Two cases fall back to the full
load (None): torch's legacy (pre-1.6) format, which cannot be mapped, and a file whose
entity tower has no pooler, where the model's own randomly initialised pooler is part of
the state.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import zipfile
from typing import Any, Iterator, Mapping, NamedTuple

import torch

from dist_nce.modeling.blink import (
    BLINK_SIDES,
    bert_architecture,
    check_bert_weights,
    load_state_file,
    read_architecture_file,
    split_blink_state,
)
from dist_nce.modeling.encoder import transformer_from_config
from dist_nce.modeling.retriever import RetrieverConfig, entity_state

_MADV_DONTNEED = 4  # linux/mman.h; the same value on every Linux architecture


def _drop_pages(t: torch.Tensor) -> None:
    """Give back the resident pages of the file mapping under ``t``'s storage. They are clean
    (never written), so a later read faults them in again from the file: only memory is saved.
    Best effort: where madvise is not available the pages stay until the mapping goes."""
    storage = t.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if not nbytes:
        return
    first = start - start % mmap.PAGESIZE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(start + nbytes - first), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


class MappedWeights(Mapping[str, torch.Tensor]):
    """name -> a fresh copy of the file's tensor in ``dtypes[name]``, its mapped pages dropped after."""

    def __init__(self, mapped: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]):
        self._mapped, self._dtypes = mapped, dict(dtypes)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._mapped[name]
        out = t.to(self._dtypes[name], copy=True).contiguous()
        _drop_pages(t)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._dtypes)

    def __len__(self) -> int:
        return len(self._dtypes)


class StreamedEntityState(NamedTuple):
    """``state``: ``EntityEncoder.state()`` with lazily read weights; the sizes the retriever would have."""

    state: dict[str, Any]
    hidden_size: int
    vocab_size: int  # the mention encoder's, which the tokenizer is checked against


def blink_entity_state(path: str | os.PathLike, config: RetrieverConfig,
                       num_attention_heads: int | None = None) -> StreamedEntityState | None:
    """The entity encoder state of :func:`~dist_nce.modeling.blink.load_blink_retriever`'s retriever
    with weights read lazily (:class:`MappedWeights`), or None where the file must be loaded
    whole (module docstring). ``config`` and ``num_attention_heads`` as for
    ``load_blink_retriever``; the same files are refused with the same messages."""
    path = os.fspath(path)
    if not zipfile.is_zipfile(path):
        return None
    sides = split_blink_state(load_state_file(path, mmap=True), source=path)
    config.validate()
    recorded = read_architecture_file(path)
    models = {}
    for side, attr in BLINK_SIDES.items():
        with torch.device("meta"):  # names, shapes, dtypes and config: no memory
            models[side] = transformer_from_config(bert_architecture(sides[side], config.mention_model,
                                                                     num_attention_heads, recorded.get(attr), path))
        kept = check_bert_weights(models[side].state_dict(), sides[side], f"{path}: {attr}")
        if side == "entity" and kept:
            return None
    hidden = {side: int(m.config.hidden_size) for side, m in models.items()}
    if hidden["mention"] != hidden["entity"]:
        raise ValueError(f"{path}: mention encoder hidden size {hidden['mention']} != entity encoder "
                         f"{hidden['entity']}; the score is an inner product")
    spec = config.spec()
    own = models["entity"].state_dict()
    weights = MappedWeights(sides["entity"], {name: t.dtype for name, t in own.items()})
    return StreamedEntityState(entity_state(models["entity"].config.to_dict(), spec, config.trim_padding, weights),
                               hidden["entity"], int(models["mention"].config.vocab_size))
