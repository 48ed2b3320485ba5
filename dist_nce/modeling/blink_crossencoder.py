"""Import and export BLINK cross-encoder checkpoints (``crossencoder_wiki_large.bin``).

BLINK (``blink/crossencoder/crossencoder.py``) saves ``CrossEncoderModule.state_dict()``:
one ``BertEncoder`` (``blink/common/ranker_base.py``) built with ``add_linear=True`` and
``out_dim=1``, whose score is ``additional_linear(dropout(pooler_output))``. The layout::

    encoder.bert_model.<BertModel key>    -> Reranker.model (a Hugging Face BertModel)
    encoder.additional_linear.weight [1, d] -> Reranker.score_layer.weight
    encoder.additional_linear.bias   [1]    -> Reranker.score_layer.bias

which is exactly :class:`~dist_nce.modeling.reranker.Reranker` with ``head="pooler"`` (pooler
-> dropout 0.1 -> Linear(d, 1)) over BLINK's input, the reranker's ``layout: blink``:
``[CLS] mention-context [SEP]`` padded to ``max_context_length`` (``context_len``), then
``entity [SEP]`` from that position on, token type 1 on the entity part, the markers
``[unused0]``/``[unused1]``/``[unused2]``. The ``bert_model.*`` keys follow the biencoder's
rules (:func:`dist_nce.modeling.blink.bert_model_key`: legacy ``LayerNorm.gamma/beta``
renamed, an ``arange`` ``embeddings.position_ids`` buffer dropped); any other key, a missing
score head, or a tensor of the wrong shape is refused by name.

Export writes the same keys (fp32 CPU tensors, ``torch.save`` of a plain dict, atomic), so
BLINK's ``CrossEncoderRanker.load_model`` (a strict ``load_state_dict``) reads it. A ``.bin``
holds weights only, so the pair layout the weights were trained on goes beside it, in
``<name>.layout.json`` (:func:`write_layout_file`): a dist-nce reranker of the packed layout
exported there is scored by BLINK in BLINK's layout, which differs on short contexts; the
file (and :func:`blink_layout_note`) says so, and reading the ``.bin`` back here restores
the packed layout from it. A ``.bin`` without the file (BLINK's own) is read as ``blink``, with the
lengths of BLINK's params file beside it (``crossencoder_wiki_large.json``) where there is one.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from dist_nce.core.artifacts import atomic_path, atomic_write_json
from dist_nce.core.config import ConfigError, from_dict
from dist_nce.modeling.blink import (
    BERT_ATTR,
    LINEAR_ATTR,
    POOLER_PREFIX,
    BlinkCheckpointError,
    bert_architecture,
    bert_model_key,
    blink_tokenizer,
    key_names,
    load_bert_weights,
    load_state_file,
    read_architecture_file,
    read_record,
    write_architecture_file,
)
from dist_nce.modeling.encoder import transformer_from_config
from dist_nce.modeling.reranker import Reranker, RerankerConfig

ENCODER_ATTR = "encoder"
BERT_PREFIX = f"{ENCODER_ATTR}.{BERT_ATTR}."
HEAD_PREFIX = f"{ENCODER_ATTR}.{LINEAR_ATTR}."
HEAD_KEYS = ("weight", "bias")
LAYOUT_KIND = "blink_crossencoder_layout"
LAYOUT_FIELDS = ("layout", "max_len", "context_len", "cand_len")


def split_crossencoder_state(
    state: Mapping[str, torch.Tensor], source: str = "<state dict>"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """BLINK cross-encoder state dict -> (``BertModel`` state with Hugging Face names,
    ``{"weight", "bias"}`` of the score layer). Unknown keys, a missing or partial head and
    a head of the wrong shape raise :class:`BlinkCheckpointError` naming the keys."""
    bert: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, value in state.items():
        if key.startswith(BERT_PREFIX):
            name = bert_model_key(key, key[len(BERT_PREFIX):], value, source)
            if name is not None:
                bert[name] = value
        elif key.startswith(HEAD_PREFIX) and key[len(HEAD_PREFIX):] in HEAD_KEYS:
            head[key[len(HEAD_PREFIX):]] = value
        else:
            unexpected.append(key)
    if unexpected:
        raise BlinkCheckpointError(f"{source}: unexpected keys {key_names(unexpected)}; expected only "
                                   f"{BERT_PREFIX}<BertModel key> and {HEAD_PREFIX}{{weight,bias}}")
    if not bert:
        raise BlinkCheckpointError(f"{source}: no {BERT_PREFIX}* keys; is this a BLINK cross-encoder? "
                                   "(a biencoder has context_encoder.* / cand_encoder.*)")
    missing = [HEAD_PREFIX + k for k in HEAD_KEYS if k not in head]
    if missing:
        raise BlinkCheckpointError(f"{source}: missing {', '.join(missing)}: the score head of a BLINK "
                                   "cross-encoder (BertEncoder with add_linear=True, out_dim=1)")
    d = bert["embeddings.word_embeddings.weight"].shape[1] if "embeddings.word_embeddings.weight" in bert else None
    want = {"weight": (1, d), "bias": (1,)}
    wrong = [f"{HEAD_PREFIX}{k} {tuple(head[k].shape)}, expected {want[k]}" for k in HEAD_KEYS
             if d is not None and tuple(head[k].shape) != want[k]]
    if wrong:
        raise BlinkCheckpointError(f"{source}: shape mismatch {'; '.join(wrong)} (out_dim must be 1, d = the "
                                   "encoder's hidden size)")
    return bert, head


def blink_reranker_from_state(
    state: Mapping[str, torch.Tensor], config: RerankerConfig | None = None, *,
    tokenizer_dir: str | os.PathLike | None = None, num_attention_heads: int | None = None,
    source: str = "<state dict>", architecture: Mapping[str, Any] | None = None,
) -> Reranker:
    """A ``head="pooler"`` :class:`Reranker` holding a BLINK cross-encoder state dict.

    ``config`` supplies ``max_len``, ``dropout``, ``trim_padding`` and the pair layout
    (default :class:`RerankerConfig`: L = 256, BLINK's ``max_seq_length``; ``layout: None``
    is BLINK's, ``context_len`` 32 and ``cand_len`` 128 as ``crossencoder_wiki_large.bin``
    was trained); ``config.model``, when set, supplies the architecture (config.json) and
    the tokenizer, else the architecture is ``architecture`` (the ``BertConfig`` dict our export
    recorded: :func:`~dist_nce.modeling.blink.read_architecture_file`) or read off the weights,
    and the tokenizer is ``tokenizer_dir`` or the default model's (bert-uncased's vocabulary).
    """
    config = config or RerankerConfig()
    if config.layout is None:
        config = dataclasses.replace(config, layout="blink")
    if config.head != "pooler":
        raise BlinkCheckpointError(f"{source}: BLINK's cross-encoder scores the pooler output; head "
                                   f"{config.head!r} cannot hold it (use head: pooler)")
    bert, head = split_crossencoder_state(state, source)
    model = transformer_from_config(bert_architecture(bert, config.model, num_attention_heads, architecture, source))
    load_bert_weights(model, bert, f"{source}: {ENCODER_ATTR}.{BERT_ATTR}")
    tokenizer = blink_tokenizer(source, tokenizer_dir or config.model, int(model.config.vocab_size))
    reranker = Reranker(config, model, tokenizer)
    if head["weight"].shape != reranker.score_layer.weight.shape:  # a model_dir of another hidden size
        raise BlinkCheckpointError(f"{source}: {HEAD_PREFIX}weight {tuple(head['weight'].shape)} vs model "
                                   f"{tuple(reranker.score_layer.weight.shape)}")
    reranker.score_layer.load_state_dict(head, strict=True)
    return reranker


def load_blink_reranker(
    path: str | os.PathLike, config: RerankerConfig | None = None, *,
    tokenizer_dir: str | os.PathLike | None = None, num_attention_heads: int | None = None,
) -> Reranker:
    """:func:`blink_reranker_from_state` of the file at ``path`` (read with ``weights_only=True``).

    With ``config.layout`` None the layout is the file's own: its ``.layout.json`` when there
    is one (our export's record of what the weights were trained on: layout, max_len,
    context_len, cand_len), else BLINK's with the lengths of BLINK's params file beside it
    (:func:`read_blink_params`), else BLINK's with ``config``'s lengths; the architecture is the
    ``.architecture.json``'s when there is one (our export's), else as :func:`blink_reranker_from_state` says."""
    config = config or RerankerConfig()
    if config.layout is None:
        recorded = read_layout_file(path)
        if recorded is None:
            recorded = read_blink_params(path, config.max_len)
        if recorded is not None:
            config = dataclasses.replace(config, **recorded)
    return blink_reranker_from_state(load_state_file(path), config, tokenizer_dir=tokenizer_dir,
                                     num_attention_heads=num_attention_heads, source=os.fspath(path),
                                     architecture=read_architecture_file(path).get(ENCODER_ATTR))


def blink_params_file(path: str | os.PathLike) -> Path:
    """BLINK's training params beside its checkpoint: ``crossencoder_wiki_large.json`` beside
    ``crossencoder_wiki_large.bin`` (what BLINK's ``main_dense.py --crossencoder_config`` reads)."""
    return Path(path).with_suffix(".json")


# BLINK's params key -> ours. BLINK's cross-encoder is trained on max_context_length mention tokens
# then the candidate's max_cand_length, each pair cut at max_seq_length (train_cross.py's modify).
BLINK_PARAM_FIELDS = {"max_context_length": "context_len", "max_cand_length": "cand_len"}


def read_blink_params(path: str | os.PathLike, max_len: int) -> dict[str, Any] | None:
    """The BLINK layout of the lengths in BLINK's params file beside ``path`` (:func:`blink_params_file`), or
    None without one: a cross-encoder trained with other lengths than ``crossencoder_wiki_large.bin`` (a
    Zeshel one: 128 context tokens) has its entity at another position, and read with the defaults it would
    score every pair wrongly without an error. The pair length is ``max_len`` or, if that cuts the candidate,
    ``max_context_length + max_cand_length``. A file that is not such params, a head other than BLINK's
    linear one, or pairs BLINK cuts inside the candidate (max_seq_length) are errors naming the file."""
    file = blink_params_file(path)
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlinkCheckpointError(f"{file}: unreadable BLINK params ({e})") from None
    if not isinstance(data, dict):
        raise BlinkCheckpointError(f"{file}: BLINK params must be a JSON object")
    missing = [k for k in BLINK_PARAM_FIELDS if k not in data]
    if missing:
        raise BlinkCheckpointError(f"{file}: BLINK params without {', '.join(missing)} (the lengths the "
                                   f"cross-encoder beside it was trained with)")
    bad = [k for k in (*BLINK_PARAM_FIELDS, "max_seq_length") if k in data
           and (not isinstance(data[k], int) or isinstance(data[k], bool) or data[k] < 2)]
    if bad:
        raise BlinkCheckpointError(f"{file}: {', '.join(f'{k} {data[k]!r}' for k in bad)}: expected an integer >= 2")
    if data.get("add_linear") is False:
        raise BlinkCheckpointError(f"{file}: add_linear false: only BLINK's cross-encoder with its linear score "
                                   "head (add_linear true, out_dim 1) is read")
    context, cand = data["max_context_length"], data["max_cand_length"]
    if "max_seq_length" in data and data["max_seq_length"] < context + cand - 1:
        raise BlinkCheckpointError(f"{file}: max_seq_length {data['max_seq_length']} < max_context_length "
                                   f"{context} + max_cand_length {cand} - 1: BLINK cut its pairs inside the "
                                   "candidate, which is not supported")
    fields = {"layout": "blink", "max_len": max(int(max_len), context + cand), "context_len": context,
              "cand_len": cand}
    try:
        from_dict(RerankerConfig, fields, str(file))  # the ranges and the layout's own check
    except ConfigError as e:
        raise BlinkCheckpointError(str(e)) from None
    return fields


def layout_file(path: str | os.PathLike) -> Path:
    """Where the pair layout of the weights in ``path`` is recorded: ``<name>.layout.json``."""
    return Path(path).with_suffix(".layout.json")


def blink_layout_note(config: RerankerConfig) -> str | None:
    """None when BLINK scores ``config``'s weights as they were trained, else what differs."""
    if config.layout == "blink":
        return None
    return (f"trained on the {config.layout!r} layout ([CLS] mention [SEP] entity [SEP], the entity right after "
            "the mention); BLINK pads the mention part to its max_context_length before the entity, so BLINK's "
            "scores equal ours only where the mention part fills it (short contexts differ); dist-nce reads the "
            "layout back from the .layout.json beside the file")


def write_layout_file(config: RerankerConfig, path: str | os.PathLike) -> Path:
    """Record ``config``'s pair layout beside the weights at ``path``; returns the record's path."""
    out = layout_file(path)
    atomic_write_json(out, {"kind": LAYOUT_KIND, **{k: getattr(config, k) for k in LAYOUT_FIELDS},
                            "blink_scores_as_trained": config.layout == "blink",
                            "note": blink_layout_note(config)})
    return out


def read_layout_file(path: str | os.PathLike) -> dict[str, Any] | None:
    """The layout fields recorded beside ``path`` (:func:`write_layout_file`), or None without a record;
    a record that is not one is an error naming the file and the key."""
    file = layout_file(path)
    data = read_record(file, LAYOUT_KIND, "layout")
    if data is None:
        return None
    missing = [k for k in LAYOUT_FIELDS if k not in data]
    if missing:
        raise BlinkCheckpointError(f"{file}: missing {', '.join(missing)}")
    fields = {k: data[k] for k in LAYOUT_FIELDS}
    try:
        from_dict(RerankerConfig, fields, str(file))  # types, ranges and the layout's own check
    except ConfigError as e:
        raise BlinkCheckpointError(str(e)) from None
    return fields


def blink_crossencoder_state(reranker: Reranker) -> dict[str, torch.Tensor]:
    """The reranker as a BLINK ``CrossEncoderModule`` state dict (fp32 CPU copies)."""
    if reranker.config.head != "pooler":
        raise BlinkCheckpointError(f"head {reranker.config.head!r}: BLINK's cross-encoder scores the pooler "
                                   "output; only head 'pooler' has its layout")
    model_type = reranker.model.config.model_type
    if model_type != "bert":
        raise BlinkCheckpointError(f"the reranker's encoder is {model_type!r}; the BLINK layout holds BERT only")
    state = reranker.model.state_dict()
    if not any(k.startswith(POOLER_PREFIX) for k in state):
        raise BlinkCheckpointError("the reranker's encoder has no pooler; BLINK's strict load needs pooler.*")
    out = {BERT_PREFIX + k: v for k, v in state.items()}
    out.update({HEAD_PREFIX + k: v for k, v in reranker.score_layer.state_dict().items()})
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in out.items()}


def export_blink_crossencoder(reranker: Reranker, path: str | os.PathLike) -> Path:
    """Write ``reranker`` as a BLINK cross-encoder checkpoint (atomic ``torch.save``) and, beside it,
    its pair layout (:func:`write_layout_file`) and architecture
    (:func:`~dist_nce.modeling.blink.write_architecture_file`); return the checkpoint's path.

    The file holds weights only: BLINK's own pair length, context length and dropout come
    from its params, not from this reranker's config, and BLINK always builds its own layout
    (:func:`blink_layout_note` says what that changes for a packed reranker).
    """
    state = blink_crossencoder_state(reranker)
    path = Path(path)
    # the records first: a .bin never stands without them, so a packed export is never read back as
    # BLINK's layout, nor a model with other than 64-dimensional heads with guessed heads
    write_layout_file(reranker.config, path)
    write_architecture_file(path, {ENCODER_ATTR: reranker.model})
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path
