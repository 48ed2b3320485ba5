"""The joint cross-encoder reranker (paper, section 5: "BERT joint reranker").

One transformer reads a mention and a candidate together,
``[CLS] mention [SEP] entity [SEP]`` with token types 0 and 1, and a linear layer on
the first position gives the score. It is trained with the same NCE loss as the
retrievers (gold at index 0 of K candidates, eq. 7), over each retriever's top-64.

Pairs are built from the token ids the prepared KB already stores, so the reranker
never re-tokenizes text:

* mention ids ``[CLS] left [unused0] m [unused1] right [SEP]`` -> the content between
  CLS and SEP, re-cut to at most ``(L-3)//2`` tokens by ``dist_nce.core.text``'s own rule
  (markers kept, the mention centred, the left context offered the floor half of the
  remaining quota), so a pair holds the same mention window a fresh tokenization would;
* entity ids ``[CLS] title [unused2] description [SEP]`` -> the content between CLS and
  SEP, cut to whatever the mention part left of ``L-3``. The paper's code caps the
  entity at ``(L-3) - (L-3)//2`` even when the mention context is short; giving the
  entity the unused mention budget only adds description tokens.

Two pair layouts (``RerankerConfig.layout``), a property of the weights, recorded with them:

* ``"packed"`` (dist-nce's own rerankers, :func:`build_pairs`): the entity follows the
  mention's [SEP] at once, ``[CLS] mention [SEP] entity [SEP] pad...``;
* ``"blink"`` (BLINK's cross-encoders, :func:`build_blink_pairs`): BLINK pads the mention
  part ``[CLS] mention [SEP]`` to its ``max_context_length`` (``context_len``, 32 for
  ``crossencoder_wiki_large.bin``) before appending the candidate without its [CLS]
  (``blink/crossencoder/train_cross.py`` ``modify``), so the entity always starts at
  position ``context_len``; the padding in between is masked and has token type 0.

The two agree when the mention part fills ``context_len``; on a short context the entity
sits at other positions, and a BLINK cross-encoder read in the packed layout gives other
scores (an outside test saw differences up to 2.9 and another top-1 for an 11-token
context). So a BLINK file is read as ``"blink"`` and a new reranker is ``"packed"``
(``layout: None`` picks that); a saved reranker's manifest records its layout.

Score head (``RerankerConfig.head``): ``"pooler"`` (default) follows the paper's code:
BERT pooler (dense + tanh on [CLS]) -> dropout 0.1 -> Linear(d, 1), the linear layer
initialised N(0, initializer_range) with zero bias. ``"cls"`` puts the same dropout +
linear layer directly on the [CLS] hidden state (the pooler is then frozen).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dist_nce.core.artifacts import MANIFEST, ArtifactMismatch, atomic_path, read_manifest, write_manifest
from dist_nce.core.config import Range, check_fields, from_dict, to_dict
from dist_nce.core.models import default_model_dir
from dist_nce.core.text import SpecialIds, assemble_mention_ids, load_tokenizer, special_ids, tokenizer_fingerprint
from dist_nce.modeling.encoder import load_transformer, trim_padding

SCHEMA_VERSION = 1
MANIFEST_KIND = "reranker"


@dataclass
class RerankerConfig:
    model: str | None = field(
        default=None, metadata={"help": "Hugging Face model directory; None = dist_nce.core.models.default_model_dir()"}
    )
    max_len: int = field(default=256, metadata={
        "help": "pair length L; the mention part gets at most (L-3)//2 in the packed layout",
        "range": Range(ge=9, why="the mention part needs its two markers and one token: (L-3)//2 >= 3")})
    head: Literal["pooler", "cls"] = field(
        default="pooler",
        metadata={"help": "'pooler': pooler->dropout->linear (paper's code); 'cls': dropout->linear on [CLS]"},
    )
    dropout: float = field(default=0.1, metadata={"help": "dropout before the score layer",
                                                  "range": Range(ge=0, lt=1)})
    trim_padding: bool = field(
        default=True, metadata={"help": "drop all-padding columns of a batch before the transformer"}
    )
    layout: Literal["packed", "blink"] | None = field(default=None, metadata={"help": (
        "pair layout (module docstring): 'packed' [CLS] mention [SEP] entity [SEP]; 'blink' BLINK's, the "
        "mention part padded to context_len so the entity starts there. None = the checkpoint's own: a saved "
        "directory's manifest, a BLINK file's .layout.json (written by our export) or else 'blink'; 'packed' "
        "for a new reranker")})
    context_len: int = field(default=32, metadata={
        "help": "layout 'blink': positions of [CLS] mention [SEP] and its padding (BLINK's max_context_length)",
        "range": Range(ge=5, why="[CLS], the two markers, one mention token and [SEP]")})
    cand_len: int = field(default=128, metadata={
        "help": "layout 'blink': BLINK's max_cand_length; the entity keeps at most cand_len - 2 tokens",
        "range": Range(ge=3, why="[CLS], one token and [SEP]")})

    def validate(self) -> None:
        check_fields(self)  # the loader did already; direct constructions did not
        if self.layout == "blink" and self.max_len < self.context_len + 2:
            raise ValueError(f"layout 'blink': max_len {self.max_len} leaves no room for an entity after "
                             f"context_len {self.context_len} (need max_len >= context_len + 2)")


class Pairs(NamedTuple):
    """``ids``, ``token_type_ids``, ``mask``: [B, K, L] (mask bool)."""

    ids: torch.Tensor
    token_type_ids: torch.Tensor
    mask: torch.Tensor


def _content_lengths(ids: torch.Tensor, sp: SpecialIds, what: str) -> torch.Tensor:
    """Real length of right-padded ``[CLS] ... [SEP]`` rows [..., T] -> [...], checking the frame."""
    lengths = (ids != sp.pad).sum(-1)
    flat_ids, flat_len = ids.reshape(-1, ids.shape[-1]), lengths.reshape(-1)
    last = flat_ids.gather(1, (flat_len - 1).clamp(min=0)[:, None])[:, 0]
    bad = (flat_len < 2) | (flat_ids[:, 0] != sp.cls) | (last != sp.sep)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"{what} row {row} (flattened) is not a right-padded [CLS] ... [SEP] sequence: "
            f"{flat_ids[row, : int(flat_len[row]) + 1].tolist()}"
        )
    return lengths


def mention_windows(ids: torch.Tensor, sp: SpecialIds, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mention part of each pair: at most ``budget`` tokens around the marked mention.

    ids: [B, T] ``[CLS] left [unused0] m [unused1] right [SEP] pad...`` -> (window [B, W]
    right-padded, lengths [B]), W <= budget. The cut is ``dist_nce.core.text``'s own
    (:func:`~dist_nce.core.text.assemble_mention_ids` with ``budget + 2`` ids, CLS/SEP then
    dropped): markers kept, mention truncated only if it alone does not fit, left
    context offered the floor half of the rest. One short Python step per mention,
    not per (mention, candidate) pair.
    """
    lengths = _content_lengths(ids, sp, "mention")
    windows = []
    for row, (seq, n) in enumerate(zip(ids.tolist(), lengths.tolist())):
        seq = seq[1 : n - 1]
        if seq.count(sp.mention_start) != 1 or seq.count(sp.mention_end) != 1:
            raise ValueError(
                f"mention row {row} needs exactly one [unused0] and one [unused1] (ids {sp.mention_start}/"
                f"{sp.mention_end}); was it tokenized with dist_nce.core.text.encode_mention? {seq}"
            )
        a, b = seq.index(sp.mention_start), seq.index(sp.mention_end)
        windows.append(assemble_mention_ids(seq[:a], seq[a + 1 : b], seq[b + 1 :], budget + 2, sp)[1:-1])
    width = max((len(w) for w in windows), default=0)
    out = torch.full((len(windows), width), sp.pad, dtype=torch.long)
    for row, w in enumerate(windows):
        out[row, : len(w)] = torch.tensor(w, dtype=torch.long)
    return out, torch.tensor([len(w) for w in windows], dtype=torch.long)


def _pair_inputs(mention_ids: Any, entity_ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as int64 tensors (store rows are numpy), shapes [B, Tm] and [B, K, Te] checked."""
    mention_ids, entity_ids = torch.as_tensor(mention_ids), torch.as_tensor(entity_ids)
    if mention_ids.dim() != 2 or entity_ids.dim() != 3 or entity_ids.shape[0] != mention_ids.shape[0]:
        raise ValueError(
            f"expected mention_ids [B, Tm] and entity_ids [B, K, Te], got {tuple(mention_ids.shape)} "
            f"and {tuple(entity_ids.shape)}"
        )
    return mention_ids.long(), entity_ids.long()


def build_pairs(
    mention_ids: torch.Tensor, entity_ids: torch.Tensor, sp: SpecialIds, max_len: int
) -> Pairs:
    """``[CLS] mention-window [SEP] entity [SEP] pad...`` for every (mention, candidate).

    mention_ids: [B, Tm], entity_ids: [B, K, Te] (tensors or arrays; BLINK-format rows as stored in the
    prepared KB, right-padded) -> Pairs of [B, K, max_len]. Token type 0 covers
    ``[CLS] mention [SEP]``, 1 covers ``entity [SEP]``; padding has type 0 and mask False.
    Vectorised over the B*K pairs: gathers over index arithmetic, no per-pair Python.
    """
    mention_ids, entity_ids = _pair_inputs(mention_ids, entity_ids)
    b, k, te = entity_ids.shape
    window, m_len = mention_windows(mention_ids, sp, (max_len - 3) // 2)
    e_len = torch.minimum(_content_lengths(entity_ids, sp, "entity") - 2, (max_len - 3 - m_len)[:, None])

    j = torch.arange(max_len)[None, None, :]  # output position
    lm, le = m_len[:, None, None], e_len[:, :, None]
    in_mention = (j >= 1) & (j <= lm)
    in_entity = (j >= lm + 2) & (j < lm + 2 + le)
    m_src = (j - 1).clamp(0, max(window.shape[1] - 1, 0)).expand(b, k, max_len)
    e_src = (j - lm - 1).clamp(0, te - 1).expand(b, k, max_len)
    from_mention = window[:, None, :].expand(b, k, -1).gather(2, m_src)
    from_entity = entity_ids.gather(2, e_src)

    ids = torch.full((b, k, max_len), sp.pad, dtype=torch.long)
    ids = torch.where(in_mention, from_mention, ids)
    ids = torch.where(in_entity, from_entity, ids)
    sep = (j == lm + 1) | (j == lm + 2 + le)
    ids = torch.where(sep, torch.full_like(ids, sp.sep), ids)
    ids[..., 0] = sp.cls
    mask = j <= lm + 2 + le
    token_type = ((j >= lm + 2) & mask).long()
    return Pairs(ids, token_type, mask.expand(b, k, max_len))


def build_blink_pairs(
    mention_ids: torch.Tensor, entity_ids: torch.Tensor, sp: SpecialIds, max_len: int, context_len: int,
    cand_len: int,
) -> Pairs:
    """BLINK's cross-encoder input for every (mention, candidate), C = ``context_len``::

        [CLS] mention-window [SEP] pad... (to C)  entity [SEP] pad... (to max_len)

    mention_ids: [B, Tm], entity_ids: [B, K, Te] (prepared-KB rows, right-padded) -> Pairs of
    [B, K, max_len]. The window is at most C - 2 tokens (BLINK's ``get_context_representation``
    at ``max_context_length`` C: the same cut as :func:`mention_windows`); the entity keeps at
    most ``cand_len - 2`` tokens (BLINK's ``max_cand_length``) and starts at position C. As
    BLINK's ``modify`` and ``to_bert_input``: the pair is cut to ``max_len`` (then without the
    final [SEP]), token type 1 covers every real token from C on, and the mask is False on
    padding, including the padding between the two parts.
    """
    mention_ids, entity_ids = _pair_inputs(mention_ids, entity_ids)
    if max_len < context_len + 2:
        raise ValueError(f"max_len {max_len} < context_len {context_len} + 2: no room for an entity")
    b, k, te = entity_ids.shape
    window, m_len = mention_windows(mention_ids, sp, context_len - 2)
    e_len = (_content_lengths(entity_ids, sp, "entity") - 2).clamp(max=min(cand_len - 2, max_len - context_len))

    j = torch.arange(max_len)[None, None, :]  # output position
    lm, le, c = m_len[:, None, None], e_len[:, :, None], context_len
    in_mention = (j >= 1) & (j <= lm)
    in_entity = (j >= c) & (j < c + le)
    m_src = (j - 1).clamp(0, max(window.shape[1] - 1, 0)).expand(b, k, max_len)
    e_src = (j - c + 1).clamp(0, te - 1).expand(b, k, max_len)
    from_mention = window[:, None, :].expand(b, k, -1).gather(2, m_src)
    from_entity = entity_ids.gather(2, e_src)

    ids = torch.full((b, k, max_len), sp.pad, dtype=torch.long)
    ids = torch.where(in_mention, from_mention, ids)
    ids = torch.where(in_entity, from_entity, ids)
    # j == c + le is past the last column when the entity was cut at max_len: no [SEP], as BLINK's cut
    sep = (j == lm + 1) | (j == c + le)
    ids = torch.where(sep, torch.full_like(ids, sp.sep), ids)
    ids[..., 0] = sp.cls
    mask = ((j <= lm + 1) | ((j >= c) & (j <= c + le))).expand(b, k, max_len)
    token_type = ((j >= c) & mask).long()
    return Pairs(ids, token_type, mask)


def layout_pairs(config: RerankerConfig, mention_ids: Any, entity_ids: Any, sp: SpecialIds) -> Pairs:
    """The pairs of ``config.layout`` (None is the packed layout of a new reranker)."""
    if config.layout == "blink":
        return build_blink_pairs(mention_ids, entity_ids, sp, config.max_len, config.context_len, config.cand_len)
    return build_pairs(mention_ids, entity_ids, sp, config.max_len)


class Reranker(nn.Module):
    """Cross-encoder: forward(Pairs [B, K, L]) -> scores [B, K]."""

    def __init__(self, config: RerankerConfig, model: nn.Module, tokenizer: Any = None):
        super().__init__()
        if config.layout is None:  # a new reranker (or one saved before layouts were recorded): packed
            config = dataclasses.replace(config, layout="packed")
        config.validate()
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos is not None and config.max_len > max_pos:
            raise ValueError(f"max_len {config.max_len} exceeds the model's max_position_embeddings {max_pos}")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        pooler = getattr(model, "pooler", None)
        if config.head == "pooler" and pooler is None:
            raise ValueError(f"head='pooler' needs a model with a pooler; {type(model).__name__} has none")
        if config.head == "cls" and pooler is not None:
            pooler.requires_grad_(False)  # unused: keep it out of the trainable set
        d = int(model.config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)
        self.score_layer = nn.Linear(d, 1)
        # As the paper's code (BERT's own initialisation for a new linear layer).
        nn.init.normal_(self.score_layer.weight, mean=0.0, std=float(getattr(model.config, "initializer_range", 0.02)))
        nn.init.zeros_(self.score_layer.bias)

    @classmethod
    def build(cls, config: RerankerConfig) -> "Reranker":
        model_dir = config.model or default_model_dir()
        return cls(config, load_transformer(model_dir), load_tokenizer(model_dir))

    @property
    def special_ids(self) -> SpecialIds:
        if self.tokenizer is None:
            raise ValueError("this Reranker has no tokenizer; pass one or build with Reranker.build/from_pretrained")
        return special_ids(self.tokenizer)

    def forward(self, pairs: Pairs) -> torch.Tensor:
        ids, types, mask = pairs
        if not ids.shape == types.shape == mask.shape or ids.dim() != 3:
            raise ValueError(
                f"expected ids, token_type_ids, mask all [B, K, L], got {tuple(ids.shape)}, "
                f"{tuple(types.shape)}, {tuple(mask.shape)}"
            )
        b, k, length = ids.shape
        if self.config.trim_padding:
            keep = trim_padding(ids, mask)[0].shape[-1]
            ids, types, mask = ids[..., :keep], types[..., :keep], mask[..., :keep]
        out = self.model(
            input_ids=ids.reshape(b * k, -1),
            attention_mask=mask.reshape(b * k, -1).long(),
            token_type_ids=types.reshape(b * k, -1),
        )
        first = out.pooler_output if self.config.head == "pooler" else out.last_hidden_state[:, 0]
        return self.score_layer(self.dropout(first)).reshape(b, k)

    def score(self, mention_ids: torch.Tensor, entity_ids: torch.Tensor) -> torch.Tensor:
        """mention_ids [B, Tm], entity_ids [B, K, Te] (prepared-KB rows, any device) -> scores [B, K].

        The pairs are laid out on the CPU (:meth:`pairs`' index arithmetic), then moved to the model.
        """
        pairs = self.pairs(torch.as_tensor(mention_ids).cpu(), torch.as_tensor(entity_ids).cpu())
        device = next(self.parameters()).device
        return self(type(pairs)(*(t.to(device) for t in pairs)))

    def pairs(self, mention_ids: Any, entity_ids: Any) -> Pairs:
        """mention_ids [B, Tm], entity_ids [B, K, Te] (CPU) -> Pairs [B, K, L] in this reranker's layout."""
        return layout_pairs(self.config, mention_ids, entity_ids, self.special_ids)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``encoder/`` (Hugging Face format), ``head.safetensors``, ``tokenizer/``, ``manifest.json``."""
        with atomic_path(directory) as tmp:
            tmp.mkdir()
            self.model.save_pretrained(tmp / "encoder")
            head = {k: v.detach().cpu().contiguous() for k, v in self.score_layer.state_dict().items()}
            save_file(head, str(tmp / "head.safetensors"))
            fields: dict[str, Any] = {}
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp / "tokenizer"))
                fields["tokenizer"] = tokenizer_fingerprint(self.tokenizer)
            write_manifest(
                tmp, MANIFEST_KIND, SCHEMA_VERSION,
                config=to_dict(self.config), hidden_size=int(self.model.config.hidden_size),
                model_type=self.model.config.model_type, **fields,
            )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, expect: dict[str, Any] | None = None) -> "Reranker":
        """Load a directory written by :meth:`save_pretrained`; a manifest of another kind,
        schema version, or differing from ``expect`` raises ``ArtifactMismatch``."""
        directory = Path(directory)
        manifest = read_manifest(directory, MANIFEST_KIND, SCHEMA_VERSION, expect)
        config = from_dict(RerankerConfig, manifest["config"], source=f"{directory / MANIFEST}: config")
        model = load_transformer(directory / "encoder")
        if int(model.config.hidden_size) != manifest["hidden_size"]:
            raise ArtifactMismatch(
                f"{directory / 'encoder'}: hidden size {model.config.hidden_size}, "
                f"manifest says {manifest['hidden_size']}"
            )
        tokenizer = None
        if (directory / "tokenizer").is_dir():
            tokenizer = load_tokenizer(str(directory / "tokenizer"))
        reranker = cls(config, model, tokenizer)
        head = load_file(str(directory / "head.safetensors"))
        want = {k: tuple(v.shape) for k, v in reranker.score_layer.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in head.items()}
        if got != want:
            raise ArtifactMismatch(f"{directory / 'head.safetensors'}: tensors {got}, expected {want}")
        reranker.score_layer.load_state_dict(head)
        return reranker
