"""The retriever a run starts from, and the model it exports at the end.

Initialisation (``model`` section): a BLINK biencoder checkpoint, a dist-nce retriever
directory (``init_from``), or pretrained Hugging Face encoders. The driver (to build
index version 0) and every worker build the same model: pretrained weights are read
from disk and learned codes (poly/genpoly) are drawn after seeding torch with the run seed.

Export: ``Retriever.save_pretrained`` (Hugging Face directories + manifest) and, for the
dual preset, BLINK's ``biencoder`` layout (``modeling.blink.export_blink``). BLINK scores
every model as dual, so a multi-m or SOM export there would silently be another model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import Retriever
from dist_nce.train.config import ModelConfig
from dist_nce.train.refresh import gathered

MODEL_DIR = "model"
BLINK_FILE = "biencoder_blink.bin"


def check_blink_init(cfg: ModelConfig, seed: int = 0) -> None:
    """Raise ConfigError when a run from ``cfg.blink_checkpoint`` would fail once its cluster is up: the
    checkpoint does not load into the architecture of ``model.retriever.mention_model`` (its config.json),
    or it does but its hidden size is not the one the shards are sized from (that model's, MiniLM's
    without one). Reads names and shapes only (:func:`blink_hidden_size`); nothing without a checkpoint."""
    if not cfg.blink_checkpoint:
        return
    from dist_nce.actors.service import entity_dim
    from dist_nce.core.config import ConfigError

    r = cfg.retriever
    arch = r.mention_model
    try:
        hidden = blink_hidden_size(cfg, seed)
    except ValueError as e:  # BlinkCheckpointError: a shape the architecture does not have, or no checkpoint
        where = f" (the architecture is model.retriever.mention_model's: {arch}/config.json)" if arch else ""
        raise ConfigError(f"model.blink_checkpoint: {e}{where}") from None
    want = entity_dim(r)
    if hidden != want:
        if r.entity_model:  # both towers are built from mention_model's architecture; the shards read entity_model
            source, fix = "model.retriever.entity_model", "unset model.retriever.entity_model"
        else:
            source = ("model.retriever.mention_model" if r.mention_model else
                      "the default model (MiniLM; model.retriever.mention_model is unset)")
            fix = ("set model.retriever.mention_model to a directory with the checkpoint's config.json and "
                   "tokenizer (bert-large-uncased for BLINK's released biencoder)")
        raise ConfigError(f"model.blink_checkpoint: {cfg.blink_checkpoint} holds encoders of hidden size {hidden}, "
                          f"but the shards are sized from {source}: {want}; {fix}")


def blink_hidden_size(cfg: ModelConfig, seed: int) -> int:
    """The hidden size of :func:`build_retriever`'s retriever from ``cfg.blink_checkpoint``, refused with
    its messages, without building it where the file allows (``modeling.blink_stream``: the file mapped,
    both towers checked on the meta device, the tokenizer against the embeddings).

    Why: the driver checks the checkpoint before any cluster work, and every worker then loads it. Built
    in full, the check held both BERT-large towers in fp32 beside BLINK's 2.6 GB file (5.7 GB at the
    peak, blink_stream's docstring) on the head, only to read one size. Torch's legacy format, which
    cannot be mapped, and a file without the entity tower's pooler still take the full build."""
    from dist_nce.modeling.blink import blink_tokenizer
    from dist_nce.modeling.blink_stream import blink_entity_state

    streamed = blink_entity_state(cfg.blink_checkpoint, cfg.retriever)
    if streamed is None:
        return build_retriever(cfg, seed).hidden_size
    blink_tokenizer(cfg.blink_checkpoint, cfg.retriever.mention_model, streamed.vocab_size)
    return streamed.hidden_size


def build_retriever(cfg: ModelConfig, seed: int) -> Retriever:
    torch.manual_seed(seed)
    if cfg.blink_checkpoint:
        from dist_nce.modeling.blink import load_blink_retriever

        retriever = load_blink_retriever(cfg.blink_checkpoint, cfg.retriever)
    elif cfg.init_from:
        retriever = Retriever.from_pretrained(cfg.init_from)
        if (retriever.config.preset, retriever.config.m) != (cfg.retriever.preset, cfg.retriever.m):
            raise ValueError(f"model.init_from {cfg.init_from} is {retriever.config.preset}/{retriever.config.m}, "
                             f"the config asks for {cfg.retriever.preset}/{cfg.retriever.m}")
    else:
        retriever = Retriever.build(cfg.retriever)
    if cfg.freeze_entity_encoder:
        retriever.entity_side.requires_grad_(False)
    return retriever


def full_state_dict(module: torch.nn.Module, zero3: bool, rank: int) -> dict[str, torch.Tensor] | None:
    """fp32 CPU copy of the whole model on rank 0 (None elsewhere); a collective under ZeRO-3."""
    with gathered(list(module.parameters()), zero3):
        if rank != 0:
            return None
        return {k: v.detach().to("cpu", torch.float32).clone() for k, v in module.state_dict().items()}


def standalone_copy(module: Retriever, state: dict[str, torch.Tensor]) -> Retriever:
    """A plain fp32 Retriever with ``state`` (the engine's module may be bf16 or partitioned)."""
    copy = Retriever(module.config, Encoder.from_config(module.mention_encoder.config_dict()),
                     Encoder.from_config(module.entity_encoder.config_dict()), module.tokenizer)
    copy.load_state_dict(state, strict=True)
    return copy.eval()


def export_model(retriever: Retriever, output_dir: str | Path) -> dict[str, Any]:
    """Write the final model; returns {"model": dir, "blink": file or None}."""
    out = Path(output_dir)
    retriever.save_pretrained(out / MODEL_DIR)
    paths: dict[str, Any] = {"model": str(out / MODEL_DIR), "blink": None}
    if retriever.config.preset != "dual":
        paths["blink_skipped"] = f"preset {retriever.config.preset!r}: BLINK would score it as dual"
        return paths
    from dist_nce.modeling.blink import BlinkCheckpointError, export_blink

    try:
        paths["blink"] = str(export_blink(retriever, out / BLINK_FILE))
    except BlinkCheckpointError as e:  # e.g. a non-BERT encoder
        paths["blink_skipped"] = str(e)
    return paths
