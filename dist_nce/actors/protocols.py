"""What the trainers and the linker ask of the KB's shards: the ``NegativeService`` seen as a
protocol, so the workers' code, their unit tests' stand-ins and type checkers agree on one face.

``NegativeService`` (:mod:`dist_nce.actors.service`) implements it; narrower consumers declare
narrower protocols of their own (``dist_nce.bias.monitor.BiasSource``,
``dist_nce.retrieval.TopkSearcher``, ``dist_nce.sampling.samplers.SampleSource``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.live_rows import LiveRows
from dist_nce.sampling.samplers import MineResult, Pending, Sampler
from dist_nce.sampling.topk import ShardResult

if TYPE_CHECKING:  # the actor module imports Ray; consumers of the protocol need not
    from dist_nce.actors.shard import LseGradPart


class RefreshPending(Protocol):
    """Shards re-encoding one version (``version``): ``done()`` never blocks, ``wait()`` gives the version served."""

    version: int

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> int: ...


@runtime_checkable
class NegativeSource(Protocol):
    """The KB's shards as a training worker sees them (docs/design.md section 2).

    num_entities: the row space (removed rows included); live: its live rows; kb_version: the
    KB version served; ranges: each shard's rows.
    """

    num_entities: int
    num_shards: int
    kb_version: int
    live: LiveRows
    ranges: list[tuple[int, int]]

    def version(self) -> int: ...

    def draw(self, sampler: Sampler, mention_reps: Reps | Tensor, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]: ...

    def mine(self, mention_reps: Reps | Tensor, gold: Tensor, n_hard: int, n_random: int, seed: int,
             query_keys: Tensor, p_mixed: float | None = None) -> Pending[MineResult]: ...

    def topk(self, mention_reps: Reps | Tensor, k: int, gold: Tensor | None = None) -> Pending[ShardResult]: ...

    def lse_grad(self, mention_reps: Reps | Tensor, rows: Tensor | None = None,
                 version: int | None = None) -> Pending[LseGradPart]: ...

    def refresh(self, entity_state: dict | Any, version: int | None = None, wait: bool = False,
                after: int = -1) -> RefreshPending: ...

    def same_weights(self, a: int, b: int) -> bool: ...

    def use_version(self, version: int) -> bool: ...

    def sync_kb(self, kb_version: int | None = None) -> int: ...

    def apply_delta(self, kb_version: int | None = None, entity_state: dict | Any = None) -> int: ...

    def status(self) -> list[dict]: ...

    def shutdown(self) -> None: ...
