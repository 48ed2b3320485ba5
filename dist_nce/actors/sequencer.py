"""IndexSequencer: the one actor that numbers index versions and hands them to the shards in order.

Two processes change what the shards serve while a run trains: training rank 0 publishes new
entity-encoder weights (a refresh, ``train.refresh``) and the driver serves a KB delta
(``train.kb_control``). Each used to pick its own version number from what the shards held, so
a delta and the next refresh could take the same number, and a shard that got the two calls in
the other order than its neighbour served another encoding under that number: a search merged
over shards then mixed two encoders, and nothing could tell. Ray does not order the calls of a
threaded actor, even from one caller, so no numbering rule alone can fix this.

Here every version-making call goes through one queue: :meth:`IndexSequencer.submit_refresh` (and
``submit_delta``) numbers the call past every version a shard serves or builds and every one it
numbered before (:meth:`IndexSequencer._current`; a ``submit_use`` going back restarts that count at
the version gone back to, never below a delta's number), and a single thread runs the calls in
that order, each on every shard, the next only after the last shard has finished the previous
one. So every shard sees the same versions in the same order, and a version number names one
encoding. A ``submit_*`` call returns at once (the number is known before the work is done; a
refresh stays asynchronous); :meth:`wait` gives the outcome.

The actor holds no data and imports no torch (a process costs the cluster nothing but its Python).
Restarted by Ray, it numbers again from what the shards hold; a call it had queued is lost and
its :meth:`wait` says so.
"""
from __future__ import annotations

import collections
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from dist_nce.actors.calls import RetryPolicy, ShardCall, cause
from dist_nce.actors.errors import VersionUnavailable


class SequencedCallFailed(RuntimeError):
    """A sequenced call failed on at least one shard (the message names which, and why)."""


@dataclass(frozen=True)
class _Call:
    ticket: str
    version: int
    method: str  # an EntityShard method that changes the version served: refresh, apply_delta, use_version
    args: list[tuple]  # per shard


class IndexSequencer:
    """Numbers and runs the version-making calls of S shards (module docstring)."""

    def __init__(self, handles: list, policy: RetryPolicy):
        self._handles, self._policy = list(handles), policy
        self._cond = threading.Condition()
        self._queue: collections.deque[_Call] = collections.deque()
        self._outcomes: dict[str, tuple[bool, Any]] = {}
        self._made = -1  # the highest version numbered for a refresh or a delta (queued ones too), or gone back to
        self._delta_made = -1  # the highest version numbered for a delta
        threading.Thread(target=self._run, name="index-sequencer", daemon=True).start()

    # ------------------------------------------------------------------ submitting
    def submit_refresh(self, state: list, origin: str | None, version: int | None = None, after: int = -1
                       ) -> dict[str, Any]:
        """Queue ``EntityShard.refresh(state[0], version, origin)`` on every shard. ``state``: ``[ObjectRef]``
        (boxed, so that this actor never fetches the weights); ``version``: None numbers it past every version
        a shard serves or builds, every one this actor numbered, and ``after`` (:meth:`_current`). Returns
        ``{"ticket", "version"}``."""
        return self._submit("refresh", lambda v: [(state[0], v, origin)] * len(self._handles), version, after)

    def submit_delta(self, state: list | None, kb_version: int, placed: list[list[tuple[int, int]]],
                     after: int = -1) -> dict[str, Any]:
        """Queue ``EntityShard.apply_delta(state, version, kb_version, placed[i])`` on shard i, numbered
        as :meth:`submit_refresh` numbers. Returns ``{"ticket", "version"}``."""
        if len(placed) != len(self._handles):
            raise ValueError(f"submit_delta: {len(placed)} placements for {len(self._handles)} shards")
        return self._submit("apply_delta", lambda v: [(state, v, kb_version, p) for p in placed], None, after)

    def submit_use(self, version: int) -> dict[str, Any]:
        """Queue ``EntityShard.use_version(version)`` on every shard: serve an older version again (a resumed
        run), in order with the deltas and refreshes, so that none of them is applied to the version it
        replaces. Returns ``{"ticket", "version"}``."""
        return self._submit("use_version", lambda v: [(v,)] * len(self._handles), int(version), -1)

    def _submit(self, method: str, args, version: int | None, after: int) -> dict[str, Any]:
        current = self._current() if version is None else -1  # outside the lock: status calls take a while
        with self._cond:
            if version is None:
                version = max(self._made, current, int(after)) + 1
            if method != "use_version":
                self._made = max(self._made, int(version))
                if method == "apply_delta":
                    self._delta_made = max(self._delta_made, int(version))
            else:
                # Going back makes none, and the refreshes above it are made again from here on, numbered as
                # before (_current): a trainer restarted inside the job replays the refresh that made the next
                # version and the shards reuse it (same weights), as after a rerun in a new cluster. Numbered
                # past it, the replay encoded the whole KB again under a new number (the chaos test's rerun
                # ended an index version above the undisturbed run's). Never below a delta's number: a delta
                # asked again after the go-back takes a new one (KB content is not replayed by a trainer).
                self._made = max(int(version), self._delta_made)
            # a ticket is unique across restarts: a waiter never gets another call's outcome
            call = _Call(uuid.uuid4().hex, int(version), method, args(int(version)))
            self._queue.append(call)
            self._cond.notify_all()
        return {"ticket": call.ticket, "version": call.version}

    def _current(self) -> int:
        """The highest version any shard serves or is building (-1: none).

        Versions only on disk above it are left out on purpose: a rerun that went back to its checkpoint's
        version (``use_version``) replays the steps that made them, and numbering its refreshes as they were
        lets a shard reuse each one made from the same weights (an exact replay) instead of encoding the KB
        again; one made otherwise is encoded over. A shard never answers a query from such a version
        (``EntityShard._index``), so no answer mixes it with its replacement."""
        calls = [ShardCall(h, i, "status", (), {}, self._policy) for i, h in enumerate(self._handles)]
        current = -1
        for c in calls:
            s = c.get()
            current = max(current, s["served"], s["refreshing"] if s["refreshing"] is not None else -1)
        return current

    # ------------------------------------------------------------------ outcomes
    def wait(self, ticket: str, timeout: float | None = None) -> int:
        """The version served once the call ``ticket`` has finished on every shard; raises what it failed
        with (:class:`SequencedCallFailed`), TimeoutError past ``timeout``, LookupError for a ticket this
        actor never queued (it was restarted in between: the call is lost)."""
        with self._cond:
            if ticket not in self._outcomes and not any(c.ticket == ticket for c in self._queue):
                raise LookupError(f"index sequencer: no call {ticket} (the sequencer was restarted and lost it)")
            if not self._cond.wait_for(lambda: ticket in self._outcomes, timeout):
                raise TimeoutError(f"index sequencer: call {ticket} not done within {timeout} s")
            ok, value = self._outcomes[ticket]
        if ok:
            return value
        raise value

    def pending(self) -> list[int]:
        """The versions queued or running, oldest first."""
        with self._cond:
            return [c.version for c in self._queue]

    # ------------------------------------------------------------------ the one thread that calls the shards
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                call = self._queue[0]
            try:
                outcome = self._execute(call)
            except BaseException as e:  # noqa: BLE001 - a waiter must hear of it; the queue goes on
                outcome = (False, SequencedCallFailed(f"index version {call.version} ({call.method}): {e!r}"))
            with self._cond:
                self._queue.popleft()
                self._outcomes[call.ticket] = outcome
                self._cond.notify_all()

    def _execute(self, call: _Call) -> tuple[bool, Any]:
        # Encodes may take hours on a large KB: no per-call timeout, only the retries on failure.
        policy = RetryPolicy(self._policy.retries, None, self._policy.wait_version_s)
        before: list[int] = []  # apply_delta: the version each shard served before it (check_delta's answer)
        if call.method == "apply_delta":
            # Every shard is asked first whether it can (EntityShard.check_delta): a delta one shard refuses
            # (a restarted shard holds no encoder with the served weights) is applied on none, rather than on
            # some, which left the shards serving two KB versions and a later refresh mixing them.
            checks = [ShardCall(h, i, "check_delta", (state, kb, rows), {}, policy)
                      for i, (h, (state, _, kb, rows)) in enumerate(zip(self._handles, call.args))]
            before, refused = self._failures(checks)
            if refused:
                shard, first = refused[0]
                return False, SequencedCallFailed(
                    f"index version {call.version} (apply_delta): refused by shard(s) {[s for s, _ in refused]}, "
                    f"applied on none; shard {shard}: {type(first).__name__}: {first}")
        calls = [ShardCall(h, i, call.method, args, {}, policy) for i, (h, args) in enumerate(zip(self._handles,
                                                                                                  call.args))]
        served, failed = self._failures(calls)
        if not failed:
            return True, min(served)
        shard, first = failed[0]
        done = sorted(set(range(len(calls))) - {s for s, _ in failed})
        # a version no shard could find stays that for the caller (NegativeService.use_version tells it apart)
        kind = VersionUnavailable if all(isinstance(c, VersionUnavailable) for _, c in failed) else SequencedCallFailed
        undone = self._roll_back(before, policy) if before else ""
        error = kind(f"index version {call.version} ({call.method}): failed on shard(s) {[s for s, _ in failed]}"
                     + (f", done on {done}" if done else "") + undone
                     + f"; shard {shard}: {type(first).__name__}: {first}")
        error.__cause__ = first
        return False, error

    def _roll_back(self, before: list[int], policy: RetryPolicy) -> str:
        """A delta that passed every check and then failed on some shards (a shard's death, memory, disk):
        every shard serves the version it served before it again, so a delta is applied on all shards or none
        and the next refresh re-encodes one KB version under its number (it used to re-encode each shard's
        own, two KB versions under one number). Every shard, the failed ones too: a shard that died after
        persisting the delta reloads it when Ray restarts it. Returns what to add to the error."""
        calls = [ShardCall(h, i, "use_version", (v,), {}, policy) for i, (h, v) in enumerate(zip(self._handles,
                                                                                                 before))]
        stuck = self._failures(calls)[1]
        back = sorted(set(before))
        if not stuck:
            return f", rolled back to version {back[0] if len(back) == 1 else back} on every shard"
        return (f", rolled back on all but shard(s) {[s for s, _ in stuck]} (shard {stuck[0][0]}: "
                f"{type(stuck[0][1]).__name__}: {stuck[0][1]}): the shards may serve two KB versions; restart the "
                "run's service")

    @staticmethod
    def _failures(calls: list[ShardCall]) -> tuple[list[int], list[tuple[int, BaseException]]]:
        """(the values of the calls that succeeded, (shard, what it raised) of the others), every call waited for."""
        values, failed = [], []
        for c in calls:
            try:
                values.append(int(c.get()))
            except Exception as e:  # noqa: BLE001 - reported to the waiter, with which shards failed
                failed.append((c.shard, cause(e)))
        return values, failed


def start_sequencer(handles: list, policy: RetryPolicy):
    """An :class:`IndexSequencer` actor over the shard ``handles`` (owned by the caller: it ends with it)."""
    import ray

    from dist_nce.cluster.runtime import actor_runtime_env

    # Waiters block one thread each (a trainer's refresh, the driver's delta, ...): room for many.
    actor = ray.remote(IndexSequencer).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                               runtime_env=actor_runtime_env())
    return actor.remote(handles, policy)
