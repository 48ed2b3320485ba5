"""When the KB index is rebuilt from new entity-encoder weights, and how stale it is.

Rank 0 publishes ``Retriever.entity_encoder_state()`` with ONE ``ray.put`` that every shard
reads (``service.refresh(ref)``: the service numbers the version, in order with the KB deltas
it serves, and rank 0 broadcasts the number); shards re-encode their own rows and swap the
new index in. ``async`` keeps training on the previous version meanwhile (ANCE-style);
``sync`` waits, so every batch after the refresh uses the new index (the paper's mode at
epoch starts). At most one refresh is in flight: publishing the next one first waits for
the previous one, which bounds staleness and is logged as ``refresh_wait_s``.

Staleness of a batch is ``step - publish_step[v]`` where ``v`` is the index version its
negatives came from and ``publish_step[v]`` the step whose weights built it. Version 0 is
the initial index, built by the driver from the step-0 weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dist_nce.actors.protocols import NegativeSource
from dist_nce.train.config import RefreshConfig
from dist_nce.train.plan import TrainPlan


def refresh_due(cfg: RefreshConfig, frozen: bool, plan: TrainPlan, step: int) -> bool:
    """Is a refresh published before training ``step``? Never at step 0 (version 0 is current)."""
    if frozen or cfg.mode == "never" or step == 0:
        return False
    if cfg.every_steps and step % cfg.every_steps == 0:
        return True
    return cfg.at_epoch_start and plan.is_epoch_start(step)


@dataclass
class RefreshBook:
    """Versions published so far and the step whose weights built each (JSON-serialisable)."""

    version: int = 0
    publish_step: dict[int, int] = field(default_factory=lambda: {0: 0})

    def record(self, version: int, step: int) -> None:
        if version <= self.version:
            raise ValueError(f"index versions must increase: {version} after {self.version}")
        self.version = version
        self.publish_step[version] = step

    def skip_past(self, version: int) -> None:
        """Make the next published version exceed ``version`` (one the shards serve but this
        book does not know, e.g. published after the checkpoint a run resumed from)."""
        self.version = max(self.version, int(version))

    def staleness(self, step: int, version: int) -> int:
        """Steps between the weights that built ``version`` and ``step`` (-1 if unknown). A version this
        book did not publish (a KB delta's) holds the weights of the newest one it did below it: the
        sequencer runs a delta after every refresh numbered before it (``actors.sequencer``)."""
        below = [v for v in self.publish_step if v <= int(version)]
        return -1 if not below else step - self.publish_step[max(below)]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "publish_step": {str(k): v for k, v in self.publish_step.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RefreshBook":
        return cls(int(d["version"]), {int(k): int(v) for k, v in d["publish_step"].items()})


def gathered(params: list[torch.nn.Parameter], zero3: bool):
    """Context in which ZeRO-3-partitioned ``params`` are whole on every rank (a collective:
    ALL ranks must enter it). A no-op below stage 3."""
    import contextlib

    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class Publisher:
    """Publishes entity-encoder weights from rank 0 to the shards.

    ``publish(step)`` is called on every rank at the same point (the ZeRO-3 gather is a
    collective); only rank 0 ships the weights. ``put`` is ``ray.put`` (injectable for tests).
    """

    def __init__(self, service: NegativeSource, module: Any, book: RefreshBook, rank: int, zero3: bool, wait: bool,
                 put: Callable[[Any], Any] | None = None, barrier: Callable[[], None] | None = None,
                 broadcast: Callable[[Any], Any] | None = None):
        if rank != 0 and broadcast is None:
            raise ValueError("Publisher: rank > 0 needs broadcast (rank 0's version number reaches the others)")
        self.service, self.module, self.book = service, module, book
        self.rank, self.zero3, self.wait = rank, zero3, wait
        self.put = put
        self.barrier = barrier or (lambda: None)
        self.broadcast = broadcast or (lambda value: value)
        self.handle: Any = None
        self.wait_s = 0.0  # seconds blocked on refreshes (sync waits + waits for the previous one)

    def _block(self, handle: Any) -> None:
        t0 = time.perf_counter()
        handle.wait()
        self.wait_s += time.perf_counter() - t0

    def _checked(self, handle: Any) -> None:
        """:meth:`_block`, and a refresh a shard refused or lost is an error saying which version."""
        try:
            self._block(handle)
        except Exception as e:  # noqa: BLE001 - ShardUnavailable, a shard's own refusal (RayTaskError), ...
            raise RuntimeError(f"the refresh to index version {handle.version} failed: {e}") from e

    def publish(self, step: int, wait: bool | None = None) -> int:
        """Publish the current weights as the next version; returns it (all ranks agree).

        The service numbers it (past this book's versions and any KB delta's: ``actors.sequencer``), and
        rank 0 tells the others. ``wait`` overrides the mode (the final refresh before export always waits)."""
        version = None
        params = list(self.module.entity_side.parameters())
        with gathered(params, self.zero3):
            if self.rank == 0:
                if self.handle is not None:
                    # waited for even when done: wait() is what raises a refresh that failed in a shard. Asked only
                    # whether it was done, a failed async refresh was dropped, and training went on against the
                    # old index while the published version counted up.
                    self._checked(self.handle)
                state = self.module.entity_encoder_state()
                ref = self.put(state) if self.put is not None else _ray_put(state)
                self.handle = self.service.refresh(ref, after=self.book.version)
                version = self.handle.version
        version = int(self.broadcast(version))
        self.book.record(version, step)
        if self.wait if wait is None else wait:
            if self.rank == 0:
                self._checked(self.handle)
            self.barrier()
        return version

    def pending(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def finish(self) -> None:
        """Wait for the refresh in flight (rank 0), e.g. before a final evaluation."""
        if self.rank == 0 and self.handle is not None:
            self._checked(self.handle)
        self.barrier()


def _ray_put(obj: Any) -> Any:
    import ray

    return ray.put(obj)
