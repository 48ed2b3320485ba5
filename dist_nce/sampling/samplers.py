"""The sampler seam: one class per negative-sampling mode, used alike by the plan, the service
and the bias estimator and monitor.

A :class:`Sampler` draws the K-1 negatives of a batch of mentions from a
:class:`SampleSource`: the sharded ``NegativeService`` in training, or :class:`FlatScores`
(a full score matrix in one process) in the bias estimator and the reference tests. A source
offers three things only, so a sampler is written once for both:

* ``live``: the row space and its tombstones (uniform draws stay in the caller);
* ``gumbel(...)``: the exact Gumbel-top-k sample of the KB minus the gold, with the scores of
  an optional ``pool`` of rows taken from the same index version;
* ``topk(...)``: the plain top-k rows by score, gold excluded (deterministic modes).

Modes live in :mod:`dist_nce.sampling.modes`, one file each, and register themselves with
:func:`register`; ``modes.sampler_for(mode, K-1, p)`` builds one, and the config's
``negatives.mode`` literal names them. A new mode is one file there plus one literal in
``train/config.py`` (``NegativesConfig.mode``).

Every sampler returns a :class:`Pending` answer at once (``ready()`` never blocks,
``result()`` finishes once and caches), so a trainer keeps several requests in flight.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from dist_nce.sampling.live_rows import LiveRows
from dist_nce.sampling.negatives import Negatives, gumbel_topk_dense
from dist_nce.sampling.topk import ShardResult

T = TypeVar("T")
U = TypeVar("U")


class MineResult(NamedTuple):
    """negatives: ids [B, K-1] int64, log_q [B, K-1], hard [B, K-1]; version: the index version
    the hard part came from (-1 when no source search was needed); truncation: [B] estimated
    softmax mass outside the rows sampled from (candidate-mode search), None when exact."""

    negatives: Negatives
    version: int
    truncation: Tensor | None


class GumbelDraw(NamedTuple):
    """sample: the merged exact Gumbel-top-k (ids, scores, log_z, version) of the KB minus the
    gold; pool_scores: [B, P] float32 exact scores of the requested pool rows, or None."""

    sample: ShardResult
    pool_scores: Tensor | None


@runtime_checkable
class Pending(Protocol[T]):
    """An answer that may not be there yet."""

    def ready(self) -> bool: ...

    def result(self, timeout: float | None = None) -> T: ...


class Then(Generic[T, U]):
    """``finish(source.result())``, computed once on the first ``result()``; ``source`` None =
    nothing to wait for (``finish(None)``)."""

    def __init__(self, source: Pending[T] | None, finish: Callable[[T | None], U]):
        self._source, self._finish = source, finish
        self._value: U | None = None
        self._done = False

    def ready(self) -> bool:
        return self._done or self._source is None or self._source.ready()

    def result(self, timeout: float | None = None) -> U:
        if not self._done:
            parts = None if self._source is None else self._source.result(timeout)
            self._value, self._done = self._finish(parts), True
            self._source = None  # drop what the source held (object refs)
        return self._value  # type: ignore[return-value]


@runtime_checkable
class SampleSource(Protocol):
    """What a sampler draws from (module docstring).

    live: the KB's row space; gumbel: reps are the queries in the source's own form (a
    ``Reps`` for the service, ignored by :class:`FlatScores`); k <= K-1 rows per query;
    gold [B] or [B, e] int64 (-1 = none); query_keys [B] int64 Gumbel keys; pool [B, P]
    int64 rows whose scores come back in ``GumbelDraw.pool_scores``.
    """

    @property
    def live(self) -> LiveRows: ...

    def gumbel(self, reps: Any, k: int, gold: Tensor, seed: int, query_keys: Tensor,
               pool: Tensor | None = None) -> Pending[GumbelDraw]: ...

    def topk(self, reps: Any, k: int, gold: Tensor | None = None) -> Pending[ShardResult]: ...


@runtime_checkable
class Sampler(Protocol):
    """One negative-sampling mode for K-1 = ``num_negatives`` negatives per mention.

    ``n_hard`` / ``n_random`` say how many negatives come from the model's distribution and how
    many are uniform (the plan records them; a resumed run must agree); ``p_mixed`` is the
    mixed-p percentage or None.
    """

    mode: ClassVar[str]
    num_negatives: int

    @property
    def n_hard(self) -> int: ...

    @property
    def n_random(self) -> int: ...

    @property
    def p_mixed(self) -> float | None: ...

    def draw(self, source: SampleSource, reps: Any, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]: ...


# mode -> class, filled by the modules of dist_nce.sampling.modes as they are imported
MODES: dict[str, Callable[[int, float], Sampler]] = {}


def register(cls: type) -> type:
    """Class decorator: the mode ``cls.mode`` builds ``cls(num_negatives, p)``."""
    if cls.mode in MODES and MODES[cls.mode] is not cls:
        raise ValueError(f"sampling mode {cls.mode!r} is registered twice ({MODES[cls.mode]}, {cls})")
    MODES[cls.mode] = cls
    return cls


class Done:
    """A :class:`Pending` that is already there."""

    def __init__(self, value: Any):
        self._value = value

    def ready(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self._value


class FlatScores:
    """A :class:`SampleSource` over a full score matrix in one process.

    scores: [B, N] (row b: mention b's scores against every entity); the dense exact sampler
    draws from them, so every mode gives the flat reference sample of its law.
    """

    def __init__(self, scores: Tensor):
        self.scores = scores.detach()
        self._live = LiveRows.full(scores.shape[1])

    @property
    def live(self) -> LiveRows:
        return self._live

    def gumbel(self, reps: Any, k: int, gold: Tensor, seed: int, query_keys: Tensor,
               pool: Tensor | None = None) -> Pending[GumbelDraw]:
        sample = gumbel_topk_dense(self.scores, k, gold, seed, query_keys)
        pool_scores = None if pool is None else self.scores.gather(1, pool).float()
        return Done(GumbelDraw(sample, pool_scores))

    def topk(self, reps: Any, k: int, gold: Tensor | None = None) -> Pending[ShardResult]:
        return Done(gumbel_topk_dense(self.scores, k, gold, None, None))
