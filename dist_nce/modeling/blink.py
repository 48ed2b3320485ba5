"""Import and export BLINK biencoder checkpoints (``biencoder_wiki_large.bin``).

BLINK (facebookresearch/BLINK, ``blink/biencoder/biencoder.py``) saves
``BiEncoderModule.state_dict()``: two ``BertEncoder`` wrappers
(``blink/common/ranker_base.py``), each holding a pytorch-transformers 1.x
``BertModel`` as ``bert_model`` and, only when trained with ``add_linear=True``, an
``additional_linear`` projection of the pooler output. The key layout is::

    context_encoder.bert_model.<BertModel key>   -> the mention encoder
    cand_encoder.bert_model.<BertModel key>      -> the entity encoder

pytorch-transformers 1.x ``BertModel`` keys are the Hugging Face ``BertModel`` keys, so
the mapping is the prefix plus these explicit rules (anything else is an error that
names the keys):

* ``LayerNorm.gamma`` / ``LayerNorm.beta`` (pre-1.0 naming) -> ``LayerNorm.weight`` / ``.bias``;
* ``embeddings.position_ids`` (a persistent buffer in some transformers 3.x/4.x
  exports) is checked to be ``arange`` and dropped: it is not a weight;
* ``pooler.*`` is loaded when present (our encoders keep it, frozen, so an export is
  complete); when absent entirely, the model's own pooler is kept: BLINK's embedding is
  the ``[CLS]`` hidden state and never reads the pooler;
* ``additional_linear.*`` is refused: such a model embeds ``Linear(pooler_output)``,
  a different embedding than the ``[CLS]`` state our score functions read. The released
  ``biencoder_wiki_large.bin`` has no such keys (BLINK's ``add_linear`` is off).

Export writes the same layout with ``torch.save`` of a plain ``{name: tensor}`` dict,
so BLINK's own ``BiEncoderRanker.load_model`` (a strict ``load_state_dict``) reads it.
The weights do not hold the attention-head count, which BLINK takes from its params
(``bert_model: bert-large-uncased``) and which reading a file back here would otherwise
guess as hidden / 64: right for BERT base and large, wrong for a model such as
all-MiniLM-L6-v2 (hidden 384, 12 heads of 32), whose export would then load without error
and score differently. So each encoder's ``BertConfig`` goes beside the file, in
``<name>.architecture.json`` (:func:`write_architecture_file`), which BLINK ignores and
every load here reads (the cross-encoder's export writes one too).

The key rules, the exact loader and the architecture/tokenizer choice are shared with the
cross-encoder's import (:mod:`dist_nce.modeling.blink_crossencoder`); entry points load
either kind of file through :mod:`dist_nce.modeling.resolve`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from dist_nce.core.artifacts import atomic_path, atomic_write_json
from dist_nce.core.models import default_model_dir
from dist_nce.core.text import load_tokenizer
from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import Retriever, RetrieverConfig

# our side name -> BLINK's BertEncoder attribute in BiEncoderModule
BLINK_SIDES = {"mention": "context_encoder", "entity": "cand_encoder"}
BERT_ATTR = "bert_model"
LINEAR_ATTR = "additional_linear"
POSITION_IDS = "embeddings.position_ids"
POOLER_PREFIX = "pooler."
ARCHITECTURE_KIND = "blink_bert_architecture"


class BlinkCheckpointError(ValueError):
    """A BLINK checkpoint does not match the expected layout; the message names the keys."""


def key_names(keys: list[str], limit: int = 12) -> str:
    """Sorted keys for an error message; long lists are cut after ``limit`` with the count."""
    shown = ", ".join(sorted(keys)[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _rename_legacy(key: str) -> str:
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


def bert_model_key(key: str, bert_key: str, value: torch.Tensor, source: str) -> str | None:
    """The Hugging Face ``BertModel`` name of ``bert_key`` (the part of checkpoint key ``key``
    after ``bert_model.``), or None for an ``embeddings.position_ids`` buffer, which is
    checked to be ``arange`` and dropped. Shared by the biencoder and cross-encoder imports."""
    bert_key = _rename_legacy(bert_key)
    if bert_key != POSITION_IDS:
        return bert_key
    want = torch.arange(value.shape[-1]).expand_as(value)
    if not torch.equal(value.long(), want):
        raise BlinkCheckpointError(f"{source}: {key} is not arange({value.shape[-1]}); refusing to drop it")
    return None


def split_blink_state(
    state: Mapping[str, torch.Tensor], source: str = "<state dict>"
) -> dict[str, dict[str, torch.Tensor]]:
    """BLINK biencoder state dict -> ``{"mention": {...}, "entity": {...}}`` with Hugging Face
    ``BertModel`` key names. Raises :class:`BlinkCheckpointError` naming unknown keys."""
    out: dict[str, dict[str, torch.Tensor]] = {side: {} for side in BLINK_SIDES}
    unexpected: list[str] = []
    linear: list[str] = []
    for key, value in state.items():
        side = next((s for s, attr in BLINK_SIDES.items() if key.startswith(attr + ".")), None)
        if side is None:
            unexpected.append(key)
            continue
        rest = key[len(BLINK_SIDES[side]) + 1 :]
        if rest.startswith(LINEAR_ATTR + "."):
            linear.append(key)
            continue
        if not rest.startswith(BERT_ATTR + "."):
            unexpected.append(key)
            continue
        bert_key = bert_model_key(key, rest[len(BERT_ATTR) + 1 :], value, source)
        if bert_key is not None:
            out[side][bert_key] = value
    if linear:
        raise BlinkCheckpointError(
            f"{source}: keys {key_names(linear)}: this biencoder was trained with BLINK's add_linear=True "
            f"(embedding = Linear(pooler output)); dist-nce retrievers embed the [CLS] hidden state "
            f"(add_linear=False, as in biencoder_wiki_large.bin). Not supported."
        )
    if unexpected:
        cross = any(k.startswith(f"encoder.{BERT_ATTR}.") for k in unexpected)
        raise BlinkCheckpointError(
            f"{source}: unexpected keys {key_names(unexpected)}; expected only "
            f"{{context_encoder,cand_encoder}}.{BERT_ATTR}.<BertModel key>"
            + ("; this looks like a BLINK cross-encoder (encoder.bert_model.*): load it as a reranker" if cross else "")
        )
    for side, attr in BLINK_SIDES.items():
        if not out[side]:
            raise BlinkCheckpointError(f"{source}: no {attr}.{BERT_ATTR}.* keys; is this a BLINK biencoder?")
    return out


def bert_config_from_state(state: Mapping[str, torch.Tensor], num_attention_heads: int | None = None) -> dict[str, Any]:
    """A ``BertConfig`` dict with the sizes read off a ``BertModel`` state (HF names).

    The head count is not visible in the weights: it is ``num_attention_heads`` or, by
    the BERT convention of 64-dimensional heads (base: 12, large: 16), hidden / 64.
    Activation and LayerNorm eps are BERT's (and pytorch-transformers 1.x) defaults.
    """
    try:
        vocab, hidden = state["embeddings.word_embeddings.weight"].shape
        max_pos = state["embeddings.position_embeddings.weight"].shape[0]
        type_vocab = state["embeddings.token_type_embeddings.weight"].shape[0]
        intermediate = state["encoder.layer.0.intermediate.dense.weight"].shape[0]
    except KeyError as e:
        raise BlinkCheckpointError(f"missing BertModel key {e.args[0]!r}; cannot infer the architecture") from None
    layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"encoder\.layer\.(\d+)\.", k)))
    if num_attention_heads is None:
        if hidden % 64:
            raise BlinkCheckpointError(f"hidden size {hidden} is not a multiple of 64, so the attention head count "
                                       "cannot be inferred (BERT's heads are 64 wide)")
        num_attention_heads = hidden // 64
    return {
        "model_type": "bert", "vocab_size": int(vocab), "hidden_size": int(hidden),
        "num_hidden_layers": layers, "num_attention_heads": int(num_attention_heads),
        "intermediate_size": int(intermediate), "max_position_embeddings": int(max_pos),
        "type_vocab_size": int(type_vocab), "hidden_act": "gelu", "layer_norm_eps": 1e-12,
    }


def load_bert_state(encoder: Encoder, state: dict[str, torch.Tensor], side: str, source: str) -> None:
    """Load HF-named ``state`` into ``encoder`` exactly: every key accounted for by name."""
    load_bert_weights(encoder.model, state, f"{source}: {BLINK_SIDES[side]}")


def load_bert_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load HF-named ``state`` into the ``BertModel`` ``model`` exactly (a missing pooler
    keeps the model's own, as the module docstring says); errors start with ``where``."""
    own = model.state_dict()
    kept = check_bert_weights(own, state, where)
    model.load_state_dict({**state, **{k: own[k] for k in kept}}, strict=True)


def check_bert_weights(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], where: str) -> list[str]:
    """Refuse (naming the keys, after ``where``) a ``state`` whose names or shapes are not ``own``'s,
    a model's state dict (its tensors may be on the meta device: only names and shapes are read).
    Returns the pooler keys ``state`` lacks, which the model keeps (module docstring)."""
    missing = sorted(set(own) - set(state))
    pooler = sorted(k for k in own if k.startswith(POOLER_PREFIX))
    kept: list[str] = []
    if missing and missing == pooler:
        kept, missing = pooler, []  # the rule in the module docstring
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(state) & set(own)) if state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"missing {key_names(missing)}" if missing else "",
                 f"unexpected {key_names(unexpected)}" if unexpected else "",
                 f"shape mismatch {'; '.join(shapes[:6])}" if shapes else ""]
        raise BlinkCheckpointError(f"{where}: " + "; ".join(p for p in parts if p))
    return kept


def bert_architecture(
    state: Mapping[str, torch.Tensor], model_dir: str | os.PathLike | None = None,
    num_attention_heads: int | None = None, recorded: Mapping[str, Any] | None = None,
    source: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The ``BertConfig`` dict a checkpoint's ``BertModel`` weights are loaded into: ``model_dir``'s
    config.json when given, else the config ``recorded`` beside the file by our export
    (:func:`read_architecture_file`; ``num_attention_heads``, when given, replaces its head
    count), else :func:`bert_config_from_state`. The exact load then checks every size.
    ``source``: the checkpoint file, named in errors."""
    if model_dir is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.fspath(model_dir), local_files_only=True).to_dict()
    if recorded is not None:
        config = dict(recorded)
        if num_attention_heads is not None:
            config["num_attention_heads"] = int(num_attention_heads)
        return config
    try:
        return bert_config_from_state(state, num_attention_heads)
    except BlinkCheckpointError as e:
        if source is None or not Path(source).is_file():
            raise
        hint = (f"; keep {architecture_file(source).name}, which the export wrote beside it, next to it (training "
                "jobs can instead name a model directory with the architecture's config.json: "
                "model.retriever.mention_model, model.reranker.model)") if "multiple of 64" in str(e) else ""
        raise BlinkCheckpointError(f"{os.fspath(source)}: {e}{hint}") from None


def read_record(file: Path, kind: str, what: str) -> dict[str, Any] | None:
    """The JSON object of a record our exports write beside a checkpoint (``kind`` its ``"kind"``),
    or None where there is none; an unreadable one or one of another kind is an error naming ``file``."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlinkCheckpointError(f"{file}: unreadable {what} record ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise BlinkCheckpointError(f"{file}: kind {data.get('kind') if isinstance(data, dict) else data!r}, "
                                   f"expected {kind!r}")
    return data


def architecture_file(path: str | os.PathLike) -> Path:
    """Where the architecture of the BERT weights in ``path`` is recorded: ``<name>.architecture.json``."""
    return Path(path).with_suffix(".architecture.json")


def write_architecture_file(path: str | os.PathLike, encoders: Mapping[str, Any]) -> Path:
    """Record, beside the checkpoint at ``path``, the ``BertConfig`` of each encoder in it: ``encoders``
    maps BLINK's attribute (``context_encoder``, ``cand_encoder``; ``encoder`` for the cross-encoder)
    to its model. Returns the record's path (module docstring: the head count is not in the weights)."""
    configs = {attr: {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
               for attr, model in encoders.items()}
    out = architecture_file(path)
    atomic_write_json(out, {"kind": ARCHITECTURE_KIND, "encoders": configs,
                            "note": "BLINK ignores this file; dist-nce reads each encoder's architecture "
                                    "(the attention-head count is not in the weights) from it"})
    return out


def read_architecture_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """BLINK attribute -> ``BertConfig`` dict, as recorded beside ``path`` by
    :func:`write_architecture_file`; empty without a record (BLINK's own files). A record that is
    not one is an error naming the file and the key."""
    file = architecture_file(path)
    data = read_record(file, ARCHITECTURE_KIND, "architecture")
    if data is None:
        return {}
    encoders = data.get("encoders")
    if not isinstance(encoders, dict) or not encoders:
        raise BlinkCheckpointError(f"{file}: 'encoders' must map an encoder to its BertConfig")
    for attr, config in encoders.items():
        heads = config.get("num_attention_heads") if isinstance(config, dict) else None
        if not isinstance(config, dict) or config.get("model_type") != "bert":
            raise BlinkCheckpointError(f"{file}: encoders.{attr}: expected a BertConfig with model_type 'bert'")
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise BlinkCheckpointError(f"{file}: encoders.{attr}.num_attention_heads: {heads!r} is not a "
                                       "positive integer")
    return encoders


def blink_tokenizer(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None, vocab: int) -> Any:
    """The tokenizer of ``tokenizer_dir`` (default: the default model, bert-uncased's vocabulary),
    refused when it has more tokens than the checkpoint at ``path`` embeds (``vocab``)."""
    tok_dir = tokenizer_dir or default_model_dir()
    tokenizer = load_tokenizer(os.fspath(tok_dir))
    if len(tokenizer) > vocab:
        raise BlinkCheckpointError(
            f"{path}: tokenizer at {tok_dir} has {len(tokenizer)} tokens but the checkpoint embeds {vocab}"
        )
    return tokenizer


def load_state_file(path: str | os.PathLike, mmap: bool = False) -> Mapping[str, torch.Tensor]:
    """A ``torch.save``'d ``{name: tensor}`` dict, read with ``weights_only=True`` (no code runs);
    anything else is a :class:`BlinkCheckpointError` naming ``path``. ``mmap``: the tensors map
    the file instead of being read (zip-format files only: torch's legacy format cannot be)."""
    path = os.fspath(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a file it cannot read
        raise BlinkCheckpointError(f"{path}: not a torch.save'd state dict readable with weights_only=True "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BlinkCheckpointError(f"{path}: expected a state dict (name -> tensor), got {type(state).__name__}")
    return state


def read_blink_checkpoint(path: str | os.PathLike) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`load_state_file` + :func:`split_blink_state`."""
    return split_blink_state(load_state_file(path), source=os.fspath(path))


def blink_encoders(
    path: str | os.PathLike, model_dir: str | os.PathLike | None = None, num_attention_heads: int | None = None
) -> tuple[Encoder, Encoder]:
    """(mention encoder, entity encoder) with a BLINK checkpoint's weights.

    The architecture comes from ``model_dir``'s config.json when given (e.g. a local
    bert-large-uncased directory; its sizes must match the checkpoint), else from the record
    beside the file (our exports: :func:`read_architecture_file`), else it is inferred by
    :func:`bert_config_from_state`.
    """
    sides = read_blink_checkpoint(path)
    recorded = read_architecture_file(path)
    encoders = []
    for side, attr in BLINK_SIDES.items():
        encoder = Encoder.from_config(bert_architecture(sides[side], model_dir, num_attention_heads,
                                                        recorded.get(attr), path))
        load_bert_state(encoder, sides[side], side, os.fspath(path))
        encoders.append(encoder)
    return encoders[0], encoders[1]


def load_blink_retriever(
    path: str | os.PathLike,
    config: RetrieverConfig,
    tokenizer_dir: str | os.PathLike | None = None,
    num_attention_heads: int | None = None,
) -> Retriever:
    """A retriever of any preset (``config.preset``, ``config.m``) initialised from a BLINK biencoder.

    dual reproduces BLINK; multi-m and the others start from the same encoder weights
    (learned codes, if the preset has any, are freshly initialised). The tokenizer comes
    from ``tokenizer_dir`` (default: ``config.mention_model`` or the default model, which
    shares bert-base/large-uncased's vocabulary); its size must match the embeddings.
    ``config.mention_model`` also supplies the architecture (config.json) when set.
    """
    mention, entity = blink_encoders(path, config.mention_model, num_attention_heads)
    tokenizer = blink_tokenizer(path, tokenizer_dir or config.mention_model, mention.model.config.vocab_size)
    return Retriever(config, mention, entity, tokenizer)


def blink_state(retriever: Retriever) -> dict[str, torch.Tensor]:
    """The retriever's two encoders as a BLINK ``BiEncoderModule`` state dict (CPU tensors)."""
    if retriever.codes is not None:
        raise BlinkCheckpointError(
            f"preset {retriever.config.preset!r} has learned codes, which the BLINK layout cannot hold"
        )
    out: dict[str, torch.Tensor] = {}
    for side, encoder in (("mention", retriever.mention_encoder), ("entity", retriever.entity_encoder)):
        model_type = encoder.model.config.model_type
        if model_type != "bert":
            raise BlinkCheckpointError(f"the {side} encoder is {model_type!r}; the BLINK layout holds BERT only")
        state = encoder.model.state_dict()
        if not any(k.startswith(POOLER_PREFIX) for k in state):
            raise BlinkCheckpointError(f"the {side} encoder has no pooler; BLINK's strict load needs pooler.*")
        prefix = f"{BLINK_SIDES[side]}.{BERT_ATTR}."
        out.update({prefix + k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()})
    return out


def export_blink(retriever: Retriever, path: str | os.PathLike) -> Path:
    """Write ``retriever`` as a BLINK biencoder checkpoint (atomic ``torch.save``) and its encoders'
    architecture beside it (:func:`write_architecture_file`); return the checkpoint's path.

    The file holds weights only: BLINK scores with the dot product of [CLS] states, so
    a multi-m or SOM retriever's weights load there but are scored as dual.
    """
    state = blink_state(retriever)
    path = Path(path)
    # the record first: a .bin of ours never stands without it, so it is never read back with guessed heads
    write_architecture_file(path, {BLINK_SIDES["mention"]: retriever.mention_encoder.model,
                                   BLINK_SIDES["entity"]: retriever.entity_encoder.model})
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path
