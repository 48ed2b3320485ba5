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

Score head (``RerankerConfig.head``): ``"pooler"`` (default) follows the paper's code:
BERT pooler (dense + tanh on [CLS]) -> dropout 0.1 -> Linear(d, 1), the linear layer
initialised N(0, initializer_range) with zero bias. ``"cls"`` puts the same dropout +
linear layer directly on the [CLS] hidden state (the pooler is then frozen).
"""
from __future__ import annotations

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
        "help": "pair length L; the mention part gets at most (L-3)//2",
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

    def validate(self) -> None:
        check_fields(self)  # the loader did already; direct constructions did not


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


def build_pairs(
    mention_ids: torch.Tensor, entity_ids: torch.Tensor, sp: SpecialIds, max_len: int
) -> Pairs:
    """``[CLS] mention-window [SEP] entity [SEP] pad...`` for every (mention, candidate).

    mention_ids: [B, Tm], entity_ids: [B, K, Te] (tensors or arrays; BLINK-format rows as stored in the
    prepared KB, right-padded) -> Pairs of [B, K, max_len]. Token type 0 covers
    ``[CLS] mention [SEP]``, 1 covers ``entity [SEP]``; padding has type 0 and mask False.
    Vectorised over the B*K pairs: gathers over index arithmetic, no per-pair Python.
    """
    mention_ids, entity_ids = torch.as_tensor(mention_ids), torch.as_tensor(entity_ids)  # store rows are numpy
    if mention_ids.dim() != 2 or entity_ids.dim() != 3 or entity_ids.shape[0] != mention_ids.shape[0]:
        raise ValueError(
            f"expected mention_ids [B, Tm] and entity_ids [B, K, Te], got {tuple(mention_ids.shape)} "
            f"and {tuple(entity_ids.shape)}"
        )
    mention_ids, entity_ids = mention_ids.long(), entity_ids.long()
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


class Reranker(nn.Module):
    """Cross-encoder: forward(Pairs [B, K, L]) -> scores [B, K]."""

    def __init__(self, config: RerankerConfig, model: nn.Module, tokenizer: Any = None):
        super().__init__()
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

        The pairs are laid out on the CPU (build_pairs' index arithmetic), then moved to the model.
        """
        pairs = build_pairs(torch.as_tensor(mention_ids).cpu(), torch.as_tensor(entity_ids).cpu(), self.special_ids,
                            self.config.max_len)
        device = next(self.parameters()).device
        return self(type(pairs)(*(t.to(device) for t in pairs)))

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
