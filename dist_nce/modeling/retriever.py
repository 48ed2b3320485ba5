"""The retriever: a mention encoder, an entity encoder and a score function.

``s(x, y)`` is one of the presets of :mod:`dist_nce.modeling.scoring` (paper,
section 4) over the token states of two separate transformers. Poly-m and genpoly-m
add m learned codes ``C`` [m, d] that attend over the mention's token states; they are
initialised U[0, 1) as in the authors' code (github.com/WenzhengZhang/hard-nce-el,
``torch.nn.init.uniform_`` on an [m, d] tensor).

The entity side is its own module, :class:`EntityEncoder`, because it is also what an
index shard runs: ``Retriever.entity_encoder_state()`` gives a plain dict of CPU
tensors + config (fit for ``ray.put``), and ``EntityEncoder.from_state`` /
``load_state`` rebuild or refresh a shard's copy from it. Nothing here knows about Ray.

Entity reps can be stored in half precision (``RetrieverConfig.storage_dtype``,
:func:`to_storage`). The default is float16: BERT-scale states lie far inside its
range, and it rounds each coordinate to a relative 2^-11 where bfloat16 rounds to
2^-8, which matters because hard negatives are sampled in proportion to exp(s) and a
score error moves that weight multiplicatively. bfloat16 is the choice when values may
exceed float16's 65504 (:func:`to_storage` refuses rather than store inf).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dist_nce.core.artifacts import MANIFEST, ArtifactMismatch, atomic_path, read_manifest, write_manifest
from dist_nce.core.config import AT_LEAST_1, ConfigError, check_fields, from_dict, to_dict
from dist_nce.core.models import default_model_dir
from dist_nce.core.text import load_tokenizer, tokenizer_fingerprint
from dist_nce.modeling.encoder import Encoder, trim_padding
from dist_nce.modeling.packed import ATTENTION, lengths_of
from dist_nce.modeling.scoring import PRESETS, Reps, ScoreSpec, entity_reps, mention_reps, score_all, score_candidates

SCHEMA_VERSION = 1
MANIFEST_KIND = "retriever"
STATE_FORMAT = 1
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RetrieverConfig:
    preset: Literal["dual", "poly", "multi", "som", "genpoly"] = field(
        default="dual", metadata={"help": f"score function, one of {list(PRESETS)} (paper, section 4)"}
    )
    m: int | None = field(
        default=None, metadata={"help": "vectors/codes for poly, multi, genpoly; unset for dual, som",
                                "range": AT_LEAST_1}
    )
    mention_model: str | None = field(
        default=None, metadata={"help": "Hugging Face model directory for the mention encoder; None = default model"}
    )
    entity_model: str | None = field(
        default=None, metadata={"help": "model directory for the entity encoder; None = same as mention_model"}
    )
    storage_dtype: Literal["float32", "float16", "bfloat16"] = field(
        default="float16", metadata={"help": "dtype of stored entity reps (see module docstring)"}
    )
    trim_padding: bool = field(
        default=True, metadata={"help": "drop all-padding columns of a batch before the transformer (same result)"}
    )
    pack_tokens: bool = field(
        default=False, metadata={"help": "training step: only the real tokens go through the transformers "
                                         "(modeling.packed; same scores up to rounding, dropout draws differ)"}
    )
    packed_attention: Literal["auto", "nested", "padded"] = field(
        default="auto", metadata={"help": "attention over packed rows: nested (FlashAttention varlen on "
                                          "CUDA), padded (the model's own over rows padded to the longest), "
                                          "auto = nested on CUDA, padded elsewhere"}
    )

    def validate(self) -> None:
        check_fields(self)  # the loader did already; direct constructions did not
        self.spec()
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {list(STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        if self.packed_attention not in ATTENTION:
            raise ValueError(f"packed_attention must be one of {list(ATTENTION)}, got {self.packed_attention!r}")

    def spec(self) -> ScoreSpec:
        return ScoreSpec.preset(self.preset, m=self.m)


def to_storage(reps: Reps, dtype: str | torch.dtype) -> Reps:
    """Cast reps' vectors to the storage dtype (``"float16"``, ``"bfloat16"``, ``"float32"``).

    Refuses float16 when a value is outside its range rather than storing inf.
    """
    dtype = STORAGE_DTYPES[dtype] if isinstance(dtype, str) else dtype
    vecs = reps.vecs.detach()
    if dtype == torch.float16 and vecs.numel():
        peak = float(vecs.abs().max())
        limit = torch.finfo(torch.float16).max
        if peak > limit:
            raise ValueError(f"entity reps reach |x| = {peak:.4g} > float16 max {limit}; store them as bfloat16")
    return Reps(vecs.to(dtype), reps.mask)


def _min_len(spec: ScoreSpec, side: str) -> int:
    reduction, count = getattr(spec, f"{side}_side")
    return count if reduction == "first" else 1


def entity_state(transformer_config: dict[str, Any], spec: ScoreSpec, trim_padding: bool,
                 weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The state of an entity encoder (:meth:`EntityEncoder.state`) from its parts; ``weights`` may be
    any mapping of name -> tensor (``dist_nce.modeling.blink_stream`` reads them from a file lazily)."""
    return {
        "format": STATE_FORMAT,
        "transformer_config": transformer_config,
        "spec": dataclasses.asdict(spec),
        "trim_padding": trim_padding,
        "weights": weights,
    }


def host_checked(mention_mask: torch.Tensor, cand_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Check a batch's masks on the host, before they go to the device: the ``mention_padded`` /
    ``cand_padded`` keywords of :meth:`Retriever.forward`, with which the forward reads nothing back,
    and ``mention_lengths`` / ``cand_lengths`` (int64 [rows], flattened) when every row is a run of
    real tokens from position 0, with which a packing retriever packs (``RetrieverConfig.pack_tokens``).

    mention_mask [B, T], cand_mask [B, K, T'] (optional), bool, on the CPU, left-aligned as
    ``train.batches.trimmed`` makes them. Every row's first token must be real (what the device
    checks: a row needs a real token, and [CLS] is read by the leftmost-m reductions) and the last
    column must be real in some row (the batch is cut to its longest row, so the device has nothing
    left to trim). Raises ValueError naming the side and row otherwise.

    Why: each device read (``trim_padding``'s length, the reductions' mask checks, transformers'
    look for padding) made the host wait for the GPU, four times per tower in every step."""
    out: dict[str, Any] = {}
    for side, mask in (("mention", mention_mask), ("cand", cand_mask)):
        if mask is None:
            continue
        if mask.device.type != "cpu" or mask.dtype != torch.bool or mask.dim() < 2:
            raise ValueError(f"host_checked: {side} mask must be a bool CPU tensor [..., T], got {mask.dtype} "
                             f"{tuple(mask.shape)} on {mask.device}")
        rows = mask.reshape(-1, mask.shape[-1])
        if rows.shape[-1] == 0 or not bool(rows[:, 0].all()):
            bad = 0 if rows.shape[-1] == 0 else int((~rows[:, 0]).nonzero()[0])
            raise ValueError(f"host_checked: {side} row {bad} (flattened) has no real first token; every row "
                             "needs at least one real token, left-aligned")
        if not bool(rows[:, -1].any()):
            raise ValueError(f"host_checked: the last {side} column is padding in every row; cut the batch to its "
                             "longest row first (train.batches.trimmed)")
        out[f"{side}_padded"] = not bool(rows.all())
        lengths = lengths_of(rows)
        if lengths is not None:
            out[f"{side}_lengths"] = lengths
    return out


class EntityEncoder(nn.Module):
    """The entity side: forward(ids [..., T], mask [..., T]) -> entity Reps with the same leading dims.

    dual / poly: [..., d]; multi-m / genpoly-m: [..., m, d] + mask; som: [..., T, d] + mask.
    With ``trim_padding`` a batch is cut to its longest row first (SOM reps then have
    T = that length; callers that store SOM reps pad back to a fixed width).
    """

    def __init__(self, encoder: Encoder, spec: ScoreSpec, trim_padding: bool = True):
        super().__init__()
        if spec.entity_side.reduction == "codes":
            raise ValueError(f"{spec}: entity-side codes are not supported by Retriever (no preset uses them)")
        self.encoder = encoder
        self.spec = spec
        self.trim_padding = trim_padding

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, padded: bool | None = None,
                lengths: torch.Tensor | None = None) -> Reps:
        """``padded`` (from :func:`host_checked`): the masks were checked on the host, so nothing is read
        back from the device (no trim, no mask check; see :meth:`Encoder.forward`). ``lengths``: the
        rows' host lengths (flattened), with which a packing encoder packs."""
        lead = ids.shape[:-1]
        ids, mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
        if self.trim_padding and padded is None:
            ids, mask = trim_padding(ids, mask, _min_len(self.spec, "entity"))
        states, mask = self.encoder(ids, mask, padded=padded, lengths=lengths)
        vecs, rmask = entity_reps(self.spec, states, mask, checked=padded is not None)
        vecs = vecs.reshape(*lead, *vecs.shape[1:])
        return Reps(vecs, None if rmask is None else rmask.reshape(*lead, *rmask.shape[1:]))

    def state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """What a shard needs to rebuild this module: config + CPU weights (copied, so
        later optimizer steps do not change the snapshot). ``dtype`` casts floating weights
        (e.g. bf16 to halve what is shipped)."""
        weights = {}
        for name, t in self.encoder.model.state_dict().items():
            t = t.detach().to("cpu")
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            weights[name] = t.clone()
        return entity_state(self.encoder.config_dict(), self.spec, self.trim_padding, weights)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EntityEncoder":
        _check_state(state)
        encoder = Encoder.from_config(state["transformer_config"])
        module = cls(encoder, ScoreSpec(**state["spec"]), state["trim_padding"])
        module.load_state(state)
        return module.eval()

    def load_state(self, state: dict[str, Any]) -> None:
        """Swap in new weights (a refresh); the architecture and spec must be the same."""
        _check_state(state)
        if ScoreSpec(**state["spec"]) != self.spec:
            raise ValueError(f"entity state has spec {state['spec']}, this encoder has {self.spec}")
        own = self.encoder.model.state_dict()
        got = state["weights"]
        if set(got) != set(own):
            raise ValueError(
                f"entity state weights differ from this encoder: missing {sorted(set(own) - set(got))[:5]}, "
                f"unexpected {sorted(set(got) - set(own))[:5]}"
            )
        self.encoder.model.load_state_dict(got, strict=True)


def _check_state(state: dict[str, Any]) -> None:
    keys = {"format", "transformer_config", "spec", "trim_padding", "weights"}
    if not isinstance(state, dict) or set(state) != keys:
        raise ValueError(f"not an entity-encoder state: expected keys {sorted(keys)}, got "
                         f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    if state["format"] != STATE_FORMAT:
        raise ValueError(f"entity-encoder state format {state['format']}, expected {STATE_FORMAT}")


class Retriever(nn.Module):
    """Mention encoder + entity encoder + score function (+ learned codes for poly/genpoly).

    ``forward(mention_ids [B, L], mention_mask, cand_ids [B, K, L'], cand_mask) -> scores [B, K]``.
    """

    def __init__(
        self, config: RetrieverConfig, mention_encoder: Encoder, entity_encoder: Encoder, tokenizer: Any = None
    ):
        super().__init__()
        config.validate()
        self.config = config
        self.spec = config.spec()
        if mention_encoder.hidden_size != entity_encoder.hidden_size:
            raise ValueError(
                f"mention encoder hidden size {mention_encoder.hidden_size} != entity encoder "
                f"{entity_encoder.hidden_size}; the score is an inner product"
            )
        self.mention_encoder = mention_encoder
        self.entity_side = EntityEncoder(entity_encoder, self.spec, config.trim_padding)
        if config.pack_tokens:
            self.use_packing(config.packed_attention)
        self.tokenizer = tokenizer
        side = self.spec.mention_side
        if side.reduction == "codes":
            self.codes: nn.Parameter | None = nn.Parameter(torch.rand(side.count, mention_encoder.hidden_size))
        else:
            self.codes = None

    @classmethod
    def build(cls, config: RetrieverConfig) -> "Retriever":
        """Both encoders (and the tokenizer) from the config's model directories."""
        config.validate()
        mention_dir = config.mention_model or default_model_dir()
        entity_dir = config.entity_model or mention_dir
        tokenizer = load_tokenizer(mention_dir)
        if entity_dir != mention_dir:  # one prepared KB feeds both sides: one vocabulary
            theirs = tokenizer_fingerprint(load_tokenizer(entity_dir))["sha256"]
            if theirs != tokenizer_fingerprint(tokenizer)["sha256"]:
                raise ValueError(f"{entity_dir}: tokenizer vocabulary differs from {mention_dir}'s; "
                                 "both encoders must read the same token ids")
        return cls(config, Encoder.from_pretrained(mention_dir), Encoder.from_pretrained(entity_dir), tokenizer)

    def use_packing(self, attention: str = "auto") -> None:
        """Run both towers packed when the forward gets the rows' lengths (``config.pack_tokens``;
        :meth:`Encoder.use_packing`)."""
        for encoder in (self.mention_encoder, self.entity_encoder):
            encoder.use_packing(attention)
        self.config.pack_tokens, self.config.packed_attention = True, attention

    @property
    def entity_encoder(self) -> Encoder:
        return self.entity_side.encoder

    @property
    def hidden_size(self) -> int:
        return self.mention_encoder.hidden_size

    def encode_mentions(self, ids: torch.Tensor, mask: torch.Tensor, padded: bool | None = None,
                        lengths: torch.Tensor | None = None) -> Reps:
        """ids, mask [B, T] -> mention Reps (dual/multi [B, d]; poly/genpoly [B, m, d]; som [B, T, d] + mask).
        ``padded``, ``lengths``: as in :meth:`EntityEncoder.forward`."""
        if self.config.trim_padding and padded is None:
            ids, mask = trim_padding(ids, mask, _min_len(self.spec, "mention"))
        states, mask = self.mention_encoder(ids, mask, padded=padded, lengths=lengths)
        return mention_reps(self.spec, states, mask, self.codes, checked=padded is not None)

    def encode_entities(self, ids: torch.Tensor, mask: torch.Tensor, padded: bool | None = None,
                        lengths: torch.Tensor | None = None) -> Reps:
        """ids, mask [..., T] -> entity Reps with the same leading dims (see :class:`EntityEncoder`)."""
        return self.entity_side(ids, mask, padded, lengths)

    def score_candidates(self, m: Reps, e: Reps, checked: bool = False) -> torch.Tensor:
        """m [B, ...], e [B, K, ...] -> [B, K]; ``checked``: see :func:`scoring.score_candidates`."""
        return score_candidates(self.spec, m, e, checked)

    def score_all(self, m: Reps, e: Reps, chunk_size: int | None = None) -> torch.Tensor:
        """m [B, ...], e [N, ...] -> [B, N]."""
        return score_all(self.spec, m, e, chunk_size)

    def forward(
        self, mention_ids: torch.Tensor, mention_mask: torch.Tensor, cand_ids: torch.Tensor | None = None,
        cand_mask: torch.Tensor | None = None, cand_reps: Reps | None = None,
        mention_padded: bool | None = None, cand_padded: bool | None = None,
        mention_lengths: torch.Tensor | None = None, cand_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores [B, K] of the candidates: token ids ``cand_ids``/``cand_mask`` [B, K, L] through the
        entity encoder, or ``cand_reps`` already encoded (vecs [B, K, ...], a frozen entity tower's
        cache: ``dist_nce.train.entity_cache``). ``mention_padded``/``cand_padded``: what
        :func:`host_checked` found on the host copies of the masks (the training step passes them, so
        its forward reads nothing back from the GPU); None: checked here, on the device.
        ``mention_lengths``/``cand_lengths``: the rows' host lengths from :func:`host_checked`, with which
        the towers run packed when ``config.pack_tokens`` (ignored otherwise)."""
        b = mention_ids.shape[0]
        if cand_reps is not None:
            if cand_reps.vecs.shape[0] != b or cand_reps.vecs.dim() < 3:
                raise ValueError(f"expected cand_reps.vecs [B, K, ...] with B={b}, got {tuple(cand_reps.vecs.shape)}")
            m = self.encode_mentions(mention_ids, mention_mask, mention_padded, mention_lengths)
            # the cache's reps were checked when it encoded them
            return self.score_candidates(m, Reps(cand_reps.vecs.to(m.vecs.dtype), cand_reps.mask),
                                         checked=mention_padded is not None)
        if cand_ids is None or cand_mask is None or cand_ids.dim() != 3 or cand_ids.shape[0] != b:
            got = None if cand_ids is None else tuple(cand_ids.shape)
            raise ValueError(f"expected cand_ids [B, K, L] with B={b}, got {got}")
        return self.score_candidates(self.encode_mentions(mention_ids, mention_mask, mention_padded, mention_lengths),
                                     self.encode_entities(cand_ids, cand_mask, cand_padded, cand_lengths),
                                     checked=mention_padded is not None and cand_padded is not None)

    def to_storage(self, reps: Reps) -> Reps:
        return to_storage(reps, self.config.storage_dtype)

    def entity_encoder_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """See :meth:`EntityEncoder.state`; rebuild with :meth:`EntityEncoder.from_state`."""
        return self.entity_side.state(dtype)

    # ------------------------------------------------------------------ artifacts

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``mention_encoder/``, ``entity_encoder/`` (each a Hugging Face model directory),
        ``tokenizer/``, ``codes.safetensors`` (poly/genpoly) and ``manifest.json``; atomic."""
        with atomic_path(directory) as tmp:
            tmp.mkdir()
            self.mention_encoder.save_pretrained(tmp / "mention_encoder")
            self.entity_encoder.save_pretrained(tmp / "entity_encoder")
            fields: dict[str, Any] = {}
            if self.codes is not None:
                save_file({"codes": self.codes.detach().cpu().contiguous()}, str(tmp / "codes.safetensors"))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp / "tokenizer"))
                fields["tokenizer"] = tokenizer_fingerprint(self.tokenizer)
            write_manifest(
                tmp, MANIFEST_KIND, SCHEMA_VERSION,
                config=to_dict(self.config), preset=self.config.preset, m=self.config.m,
                spec=dataclasses.asdict(self.spec), hidden_size=self.hidden_size,
                has_codes=self.codes is not None, **fields,
            )

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, expect: dict[str, Any] | None = None) -> "Retriever":
        """Load what :meth:`save_pretrained` wrote. A manifest of another kind or schema,
        one that disagrees with ``expect`` (e.g. ``{"preset": "multi", "m": 8}``), or files
        that disagree with the manifest raise ``ArtifactMismatch`` naming the file."""
        directory = Path(directory)
        manifest = read_manifest(directory, MANIFEST_KIND, SCHEMA_VERSION, expect)
        where = directory / MANIFEST
        try:
            config = from_dict(RetrieverConfig, manifest.get("config"), source=f"{where}: config")
        except ConfigError as e:
            raise ArtifactMismatch(str(e)) from None
        if (config.preset, config.m) != (manifest.get("preset"), manifest.get("m")):
            raise ArtifactMismatch(f"{where}: preset/m {manifest.get('preset')}/{manifest.get('m')} disagree "
                                   f"with config {config.preset}/{config.m}")
        encoders = {}
        for side in ("mention_encoder", "entity_encoder"):
            encoders[side] = Encoder.from_pretrained(directory / side)
            if encoders[side].hidden_size != manifest.get("hidden_size"):
                raise ArtifactMismatch(f"{directory / side}: hidden size {encoders[side].hidden_size}, "
                                       f"manifest says {manifest.get('hidden_size')}")
        tokenizer = None
        if (directory / "tokenizer").is_dir():
            tokenizer = load_tokenizer(str(directory / "tokenizer"))
        retriever = cls(config, encoders["mention_encoder"], encoders["entity_encoder"], tokenizer)
        codes_path = directory / "codes.safetensors"
        if retriever.codes is not None:
            if not codes_path.exists():
                raise ArtifactMismatch(f"{codes_path}: missing; preset {config.preset!r} has learned codes")
            codes = load_file(str(codes_path)).get("codes")
            if codes is None or codes.shape != retriever.codes.shape:
                got = None if codes is None else tuple(codes.shape)
                raise ArtifactMismatch(f"{codes_path}: expected tensor 'codes' of shape "
                                       f"{tuple(retriever.codes.shape)}, got {got}")
            with torch.no_grad():
                retriever.codes.copy_(codes)
        elif codes_path.exists():
            raise ArtifactMismatch(f"{codes_path}: present, but preset {config.preset!r} has no codes")
        return retriever
