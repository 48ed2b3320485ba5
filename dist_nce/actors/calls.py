"""Calls from the caller's process to the shard actors: retries, and one version per answer.

**Retries.** Ray re-runs a call whose shard died (``max_task_retries``) once Ray has
restarted the shard (``max_restarts``). A :class:`ShardCall` adds a service-level retry
on top, for what Ray does not cover: its retries exhausted, a shard that was
unreachable (``ActorUnavailableError``), or a call that hangs past ``call_timeout_s``.
Every shard method called this way is a pure function of its arguments and the index
version it answers from (searches) or idempotent (refresh), so a re-run can neither lose
nor duplicate anything.

**One version.** Shards refresh at different moments, so S answers to one query may
come from two versions. :class:`FanOut` makes them agree: it asks the shards that are
AHEAD for the oldest version seen (each shard keeps ``keep_versions`` versions in memory
and reloads older persisted ones); if one of them no longer has it, it asks the shards
that are BEHIND for the newest version, waiting for their refresh to it (running, or
still queued behind another one) to finish.
Correctness does not rest on timing: answers are merged only once every one of them
reports the same version, else the call fails loudly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dist_nce.actors.errors import VersionUnavailable


class ShardUnavailable(RuntimeError):
    """A shard call failed on every attempt."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # service-level attempts after the first
    call_timeout_s: float | None = 600.0  # None: wait forever (refresh)
    wait_version_s: float = 600.0  # how long a lagging shard may take to reach a newer version


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def cause(error: BaseException) -> BaseException:
    """The exception raised inside the actor, for a RayTaskError; else ``error`` itself."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


class ShardCall:
    """``handle.<method>.remote(*args, **kwargs)`` on shard ``shard``, re-submitted on failure."""

    def __init__(self, handle: Any, shard: int, method: str, args: tuple, kwargs: dict, policy: RetryPolicy):
        self.handle, self.shard, self.method = handle, shard, method
        self.args, self.kwargs, self.policy = args, kwargs, policy
        self.attempts = 0
        self.ref = self._submit()

    def _submit(self):
        self.attempts += 1
        return getattr(self.handle, self.method).remote(*self.args, **self.kwargs)

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], num_returns=1, timeout=0)
        return bool(ready)

    def get(self, deadline: float | None = None) -> Any:
        """The call's value. Raises TimeoutError when the caller's ``deadline`` passes first
        (the call stays in flight: ask again later), ShardUnavailable when retries run out."""
        while True:
            budget = _remaining(deadline)
            limit = self.policy.call_timeout_s
            wait = budget if limit is None else (limit if budget is None else min(limit, budget))
            try:
                return ray.get(self.ref, timeout=wait)
            except GetTimeoutError as e:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"shard {self.shard} {self.method}: not done before the caller's "
                                       "timeout (still running; call result() again)") from e
                failure: BaseException = e  # past call_timeout_s: treat the shard as stuck
                try:
                    ray.cancel(self.ref)  # best effort: a running threaded-actor task is not interrupted
                except Exception:  # noqa: BLE001 - the re-submission below is what matters
                    pass
            except RayActorError as e:
                failure = e
            if self.attempts > self.policy.retries:
                raise ShardUnavailable(f"shard {self.shard} {self.method}: failed {self.attempts} time(s); "
                                       f"last error: {failure}") from failure
            time.sleep(min(0.2 * 2 ** (self.attempts - 1), 5.0))
            self.ref = self._submit()


class FanOut:
    """One method on every shard; :meth:`result` returns answers of ONE version."""

    def __init__(self, handles: Sequence[Any], method: str, args: tuple, kwargs: dict, policy: RetryPolicy):
        self.handles, self.method, self.args, self.kwargs, self.policy = handles, method, args, kwargs, policy
        self.calls = [ShardCall(h, i, method, args, kwargs, policy) for i, h in enumerate(handles)]
        self._results: list | None = None

    def ready(self) -> bool:
        """True when every first-round answer is in (result() may still re-ask a few shards)."""
        if self._results is not None:
            return True
        refs = [c.ref for c in self.calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def result(self, timeout: float | None = None) -> list:
        if self._results is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            answers = [c.get(deadline) for c in self.calls]
            self._results = self._align(answers, deadline)
        return self._results

    def _reask(self, answers: list, version: int, wait_s: float, deadline: float | None) -> list:
        redo = {i: ShardCall(self.handles[i], i, self.method, self.args,
                             {**self.kwargs, "version": version, "wait_s": wait_s}, self.policy)
                for i, a in enumerate(answers) if a.version != version}
        return [redo[i].get(deadline) if i in redo else a for i, a in enumerate(answers)]

    def _reask_newest(self, answers: list, version: int, deadline: float | None) -> list:
        """Ask the shards behind for ``version``, which a shard ahead already serves, so their
        refresh to it is under way or queued: a shard waits for a refresh it is running, and
        one whose refresh has not started yet is asked again until ``wait_version_s``."""
        give_up = time.monotonic() + self.policy.wait_version_s
        while True:
            try:
                return self._reask(answers, version, min(_remaining(give_up), 30.0), deadline)
            except RayTaskError as e:
                if not isinstance(cause(e), VersionUnavailable) or time.monotonic() >= give_up:
                    raise
            time.sleep(0.05)

    def _align(self, answers: list, deadline: float | None) -> list:
        versions = [a.version for a in answers]
        if len(set(versions)) == 1:
            return answers
        try:
            answers = self._reask(answers, min(versions), 0.0, deadline)
        except RayTaskError as e:
            if not isinstance(cause(e), VersionUnavailable):
                raise
            answers = self._reask_newest(answers, max(versions), deadline)
        final = [a.version for a in answers]
        if len(set(final)) != 1:  # cannot happen unless a shard broke its contract
            raise RuntimeError(f"{self.method}: shards answered from versions {final} after alignment")
        return answers
