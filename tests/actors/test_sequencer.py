"""IndexSequencer: one numbering, one order of the version-making calls, over stand-in shard actors
(real local Ray; the shards record when each call ran). The real shards under it: tests/actors/
test_live_service.py (a delta and refreshes at once, a delta asked again after failing on one shard)."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import ray

from dist_nce.actors.calls import RetryPolicy
from dist_nce.actors.sequencer import start_sequencer

pytestmark = pytest.mark.ray


def test_the_actor_imports_no_torch():
    """Its process costs Python and Ray only (one more actor per service, per training run)."""
    code = "import sys, dist_nce.actors.sequencer; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def stand_in_shards(highest: list[int], fail: tuple[int, int] | None = None,
                    refuse: tuple[int, int] | None = None) -> list:
    """Threaded actors with EntityShard's refresh group: each records (what, version, args, clock) of every
    refresh / apply_delta, which sleep a little (random) so that unordered calls would overlap.
    ``highest``: the version each reports in status; ``fail``: (shard, version) whose call raises;
    ``refuse``: (shard, KB version) whose delta check_delta refuses."""

    @ray.remote(concurrency_groups={"refresh": 1}, max_concurrency=4, num_cpus=0)
    class Shard:
        def __init__(self, index: int, served: int):
            import random
            self.index, self.served, self.events, self.rng = index, served, [], random.Random(index)

        def _run(self, what: str, version: int, extra) -> int:
            import time
            self.events.append(("start", what, version, extra, time.monotonic()))
            time.sleep(self.rng.uniform(0.0, 0.03))
            self.events.append(("end", what, version, extra, time.monotonic()))
            if fail == (self.index, version):
                raise ValueError(f"stand-in shard {self.index} refuses version {version}")
            self.served = version
            return version

        @ray.method(concurrency_group="refresh")
        def refresh(self, state, version, origin):
            return self._run("refresh", version, (state, origin))

        @ray.method(concurrency_group="refresh")
        def apply_delta(self, state, version, kb_version, placed):
            return self._run("apply_delta", version, (state, kb_version, placed))

        @ray.method(concurrency_group="refresh")
        def check_delta(self, state, kb_version, placed):
            if refuse == (self.index, kb_version):
                raise ValueError(f"stand-in shard {self.index} cannot take KB version {kb_version}")
            return self.served

        def use_version(self, version):
            self.events.append(("use", "use_version", version, None, 0.0))
            self.served = version
            return version

        def status(self):
            return {"served": self.served, "refreshing": None, "persisted": [self.served - 1]}

        def recorded(self):
            return self.events

    return [Shard.remote(i, v) for i, v in enumerate(highest)]


def test_calls_from_two_callers_reach_every_shard_one_at_a_time_in_numbered_order(ray_local):
    shards = stand_in_shards([4, 2])
    sequencer = start_sequencer(shards, RetryPolicy(retries=0, call_timeout_s=60.0))
    tickets, lock = [], threading.Lock()
    state = ray.put({"weights": 1})

    def caller(kind: str) -> None:  # a trainer's refreshes, and the driver's deltas, at the same time
        for i in range(5):
            if kind == "refresh":
                t = ray.get(sequencer.submit_refresh.remote([state], "origin"))
            else:
                t = ray.get(sequencer.submit_delta.remote(None, i + 1, [[(100 + i, 101 + i)], []]))
            with lock:
                tickets.append((kind, t))

    threads = [threading.Thread(target=caller, args=(k,)) for k in ("refresh", "delta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(t["version"] for _, t in tickets) == list(range(5, 15)), "numbered past the highest held (4)"
    for _, t in tickets:
        assert ray.get(sequencer.wait.remote(t["ticket"]), timeout=60) == t["version"]
    kinds = {t["version"]: kind for kind, t in tickets}
    events = [ray.get(s.recorded.remote()) for s in shards]
    for i, shard_events in enumerate(events):
        starts = [(v, what) for edge, what, v, _, _ in shard_events if edge == "start"]
        assert starts == [(v, "refresh" if kinds[v] == "refresh" else "apply_delta") for v in range(5, 15)], i
        for edge, what, v, extra, _ in shard_events:
            if what == "apply_delta":  # each shard its own placement
                assert extra[2] == ([(100 + extra[1] - 1, 101 + extra[1] - 1)] if i == 0 else [])
            else:
                assert isinstance(extra[0], dict) and extra[1] == "origin"  # the weights, resolved by the shard
    # one at a time: a call starts on any shard only once the one before has ended on every shard
    for v in range(5, 14):
        ended = max(t for e in events for edge, _, w, _, t in e if edge == "end" and w == v)
        started = min(t for e in events for edge, _, w, _, t in e if edge == "start" and w == v + 1)
        assert ended <= started, f"version {v + 1} started before {v} had ended everywhere"
    # an explicit number passes as given; `after` numbers past a caller's own book
    assert ray.get(sequencer.submit_refresh.remote([state], None, 20))["version"] == 20
    assert ray.get(sequencer.submit_refresh.remote([state], None, None, 30))["version"] == 31
    assert ray.get(sequencer.pending.remote()) in ([20, 31], [31], [])
    for s in [*shards, sequencer]:
        ray.kill(s)


def test_a_call_that_fails_on_one_shard_says_where_and_the_queue_goes_on(ray_local):
    shards = stand_in_shards([0, 0], fail=(1, 2))
    sequencer = start_sequencer(shards, RetryPolicy(retries=0, call_timeout_s=60.0))
    first = ray.get(sequencer.submit_delta.remote(None, 1, [[(10, 12)], [(12, 14)]]))
    second = ray.get(sequencer.submit_delta.remote(None, 1, [[(10, 12)], [(12, 14)]]))
    assert (first["version"], second["version"]) == (1, 2)
    assert ray.get(sequencer.wait.remote(first["ticket"])) == 1
    with pytest.raises(Exception, match=r"index version 2 \(apply_delta\): failed on shard\(s\) \[1\], done on \[0\], "
                                        r"rolled back to version 1 on every shard; "
                                        r"shard 1: ValueError: stand-in shard 1 refuses version 2"):
        ray.get(sequencer.wait.remote(second["ticket"]))
    # applied on all or none: every shard serves version 1 again (the failed one too: it may have persisted it)
    assert [ray.get(s.status.remote())["served"] for s in shards] == [1, 1]
    assert [[e[2] for e in ray.get(s.recorded.remote()) if e[0] == "use"] for s in shards] == [[1], [1]]
    third = ray.get(sequencer.submit_refresh.remote([None], None))
    assert third["version"] == 3 and ray.get(sequencer.wait.remote(third["ticket"])) == 3
    # refused by one shard's check: applied on none (shard 0 never gets the call), the queue goes on
    for s in shards:
        ray.kill(s)
    shards = stand_in_shards([0, 0], refuse=(1, 5))
    ray.kill(sequencer)
    sequencer = start_sequencer(shards, RetryPolicy(retries=0, call_timeout_s=60.0))
    refused = ray.get(sequencer.submit_delta.remote(None, 5, [[(10, 12)], [(12, 14)]]))
    with pytest.raises(Exception, match=r"index version 1 \(apply_delta\): refused by shard\(s\) \[1\], applied on "
                                        r"none; shard 1: ValueError: stand-in shard 1 cannot take KB version 5"):
        ray.get(sequencer.wait.remote(refused["ticket"]))
    assert [ray.get(s.recorded.remote()) for s in shards] == [[], []]
    after = ray.get(sequencer.submit_delta.remote(None, 6, [[(10, 12)], [(12, 14)]]))
    assert ray.get(sequencer.wait.remote(after["ticket"])) == after["version"] == 2
    with pytest.raises(Exception, match="no call nonesuch"):
        ray.get(sequencer.wait.remote("nonesuch"))
    for s in [*shards, sequencer]:
        ray.kill(s)


def test_going_back_numbers_the_replayed_refreshes_as_before(ray_local):
    """A trainer restarted inside the job goes back to its checkpoint's version (submit_use) and replays the
    refresh that made the next one: it gets that number again, so the shards reuse what the same weights made
    (it got the next number, and the KB was encoded again under it: the chaos test saw a run end one index
    version above the undisturbed one). A delta's number is never given again."""
    shards = stand_in_shards([0, 0])
    sequencer = start_sequencer(shards, RetryPolicy(retries=0, call_timeout_s=60.0))
    made = [ray.get(sequencer.submit_refresh.remote([None], None)) for _ in range(3)]
    assert [ray.get(sequencer.wait.remote(t["ticket"])) for t in made] == [1, 2, 3]
    back = ray.get(sequencer.submit_use.remote(1))
    assert ray.get(sequencer.wait.remote(back["ticket"])) == 1
    replay = ray.get(sequencer.submit_refresh.remote([None], None))
    assert replay["version"] == 2 and ray.get(sequencer.wait.remote(replay["ticket"])) == 2
    delta = ray.get(sequencer.submit_delta.remote(None, 1, [[(10, 12)], []]))
    assert delta["version"] == 3 and ray.get(sequencer.wait.remote(delta["ticket"])) == 3
    back = ray.get(sequencer.submit_use.remote(2))  # below the delta: the next number is past it
    assert ray.get(sequencer.wait.remote(back["ticket"])) == 2
    assert ray.get(sequencer.submit_refresh.remote([None], None))["version"] == 4
    for s in [*shards, sequencer]:
        ray.kill(s)
