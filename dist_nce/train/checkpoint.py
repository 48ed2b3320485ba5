"""The retriever's part of a checkpoint, on top of the worker's (``dist_nce.worker.checkpoint``).

Beside the engine, RNG and step that every worker saves, the retriever keeps::

    train_state.json                 rank 0: + index versions and refresh steps, the KB version trained against
    epoch_negatives_rank{r}.safetensors   per_epoch mode: the epoch's mined negatives
    pending_negatives_rank{r}.safetensors pipelined mode: the negatives already mined for the
                                     next P steps (with weights the checkpoint does not hold)

The data position needs no state of its own: it is the step (see :mod:`dist_nce.train.plan`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dist_nce.train.pipeline import EpochNegatives, StepNegatives
from dist_nce.train.refresh import RefreshBook
from dist_nce.worker import checkpoint as base
from dist_nce.worker.checkpoint import (  # noqa: F401  (the checkpoint's face for the retriever's loop)
    KIND, SCHEMA_VERSION, capture_rng, install_weights_only_loading, restore_rng, weights_only_load)


def epoch_negatives_file(rank: int) -> str:
    return f"epoch_negatives_rank{rank}.safetensors"


def pending_negatives_file(rank: int) -> str:
    return f"pending_negatives_rank{rank}.safetensors"


@dataclass
class TrainState(base.WorkerState):
    """The worker's state plus the retriever's index bookkeeping."""

    book: RefreshBook = field(default_factory=RefreshBook)
    kb_version: int = 0  # the KB version the last step trained against (docs/design.md section 6)
    # The newest index version a shard served when the checkpoint was written, after its negatives (the
    # prefetched ones too) were in: above book.version only for a KB delta's version, whose rows those
    # negatives may hold. -1: not recorded (a checkpoint written before this field: book.version stands).
    index_version: int = -1
    # Per rank, [the KB version it followed, the newest index version its negatives came from] when the
    # checkpoint was written (train.kb_follow.KbFollower.resume); empty: not recorded (an older checkpoint).
    followed: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "book": self.book.to_json(), "dev_before": self.dev_before,
                "kb_version": self.kb_version, "index_version": self.index_version, "followed": self.followed}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TrainState":
        return cls(step=int(d["step"]), book=RefreshBook.from_json(d["book"]), dev_before=d.get("dev_before"),
                   kb_version=int(d.get("kb_version", 0)), index_version=int(d.get("index_version", -1)),
                   followed=[[int(k), int(v)] for k, v in d.get("followed", [])])


def extra_tensors(rank: int, epoch_negatives: EpochNegatives | None = None,
                  pending: StepNegatives | None = None) -> dict[str, dict]:
    """The retriever's tensors for ``worker.checkpoint.save`` (file name -> named tensors)."""
    out = {}
    if epoch_negatives is not None:
        out[epoch_negatives_file(rank)] = epoch_negatives.tensors()
    if pending is not None:
        out[pending_negatives_file(rank)] = pending.tensors()
    return out


def save(engine: Any, directory: str | Path, state: TrainState, rank: int, plan: dict[str, Any],
         epoch_negatives: EpochNegatives | None = None, pending: StepNegatives | None = None) -> None:
    """Write this rank's part of the checkpoint (a collective: every rank calls it)."""
    base.save(engine, directory, state, rank, plan, extra_tensors(rank, epoch_negatives, pending))


def load(engine: Any, directory: str | Path, rank: int, plan: dict[str, Any]
         ) -> tuple[TrainState, EpochNegatives | None]:
    """Restore engine (module, optimizer, scheduler), RNG and loop state from ``directory``."""
    state = base.load(engine, directory, rank, plan, TrainState)
    tensors = base.load_tensors(directory, epoch_negatives_file(rank))
    return state, EpochNegatives.from_tensors(tensors) if tensors is not None else None


def load_pending(directory: str | Path, rank: int) -> StepNegatives | None:
    """This rank's prefetched negatives saved with the checkpoint (None if there were none)."""
    tensors = base.load_tensors(directory, pending_negatives_file(rank))
    return StepNegatives.from_tensors(tensors) if tensors is not None else None
