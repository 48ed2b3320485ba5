"""NegativeService on a real local Ray: 2 EntityShard actors against one flat ShardIndex.

The reference for every answer is a single ShardIndex over ALL rows built from the
shards' persisted embeddings of the version the answer reports, so a check also proves
the answer came from exactly one version.
"""
from __future__ import annotations

import dataclasses
import pickle
import time

import pytest
import ray
import torch

from dist_nce.sampling.modes import sampler_for

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.service import NegativeService, even_ranges
from dist_nce.index.config import IndexConfig
from dist_nce.index.search import ShardIndex
from dist_nce.index.versions import PersistedVersions, shard_dir_name
from dist_nce.modeling.retriever import RetrieverConfig
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling.negatives import hard_negatives, mixed_negatives
from dist_nce.sampling.topk import merge_results

from tests.actors.test_shard import D, entity_state, write_kilt  # noqa: E402  (tests/index is on sys.path)

pytestmark = pytest.mark.ray

N, S = 150, 2
CHUNK = 32


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_model_dir):
    from kb.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("service_store")
    write_kilt(root / "ks.json", N, seed=3)
    prepare(PrepareConfig(out=str(root / "store"), kilt_ks=str(root / "ks.json"), model_dir=tiny_model_dir,
                          entity_max_len=24, rows_per_part=40, progress=False), log=lambda s: None)
    return str(root / "store")


class States:
    """Entity-encoder states, one per version (version v = weights perturbed with seed v)."""

    def __init__(self, model_dir: str):
        self.model_dir, self._cache = model_dir, {}

    def __getitem__(self, version: int) -> dict:
        if version not in self._cache:
            self._cache[version] = entity_state(self.model_dir, noise=0.03 * version, seed=version)
        return self._cache[version]


@pytest.fixture(scope="module")
def states(tiny_model_dir):
    return States(tiny_model_dir)


@pytest.fixture(scope="module")
def run(ray_local, store_dir, tiny_model_dir, states, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("service_run")
    config = ServiceConfig(num_shards=S, num_cpus=0.5, encode_batch_size=1, encode_dtype="fp32", keep_versions=2,
                           max_concurrency=4, call_timeout_s=120.0,
                           index=IndexConfig(backend="torch", chunk_rows=CHUNK))
    retriever = RetrieverConfig(preset="dual", mention_model=tiny_model_dir, storage_dtype="float32")
    service = NegativeService.create(store_dir, retriever, config, str(run_dir))
    assert service.ensure_encoded(states[0]) == 0
    yield service, run_dir
    service.shutdown()


_FLAT: dict[tuple[str, int], ShardIndex] = {}


def flat(run_dir, version: int) -> ShardIndex:
    """One ShardIndex over all N rows from the shards' persisted embeddings of ``version``
    (cached: keep_versions=2 prunes old versions from disk)."""
    if (str(run_dir), version) not in _FLAT:
        parts = [PersistedVersions(run_dir / "shards" / shard_dir_name(i, S), {}).load(version)[0]
                 for i in range(S)]
        reps = Reps(torch.cat([p.vecs for p in parts]))
        _FLAT[str(run_dir), version] = ShardIndex(ScoreSpec.preset("dual"), reps, 0, IndexConfig(backend="torch", chunk_rows=CHUNK),
                                    version)
    return _FLAT[str(run_dir), version]


def queries(seed: int, batch: int = 6) -> torch.Tensor:
    return torch.randn(batch, D, generator=torch.Generator().manual_seed(seed))


GOLD = torch.tensor([0, 74, 75, 149, -1, 77])
KEYS = torch.arange(100, 106)


def assert_same(a, b):
    assert a.version == b.version
    assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)


# --------------------------------------------------------------------------- equivalence


def test_sharded_answers_equal_one_flat_index(run):
    service, run_dir = run
    v = service.version()
    ref = flat(run_dir, v)
    q = queries(0)
    assert service.ranges == even_ranges(N, S) == [(0, 75), (75, 150)]

    top = service.topk(q, 9, GOLD).result()
    assert_same(top, ref.topk(q, 9, GOLD))
    assert not (top.ids == GOLD[:, None]).any()

    hard = service.mine(q, GOLD, n_hard=7, n_random=0, seed=11, query_keys=KEYS).result()
    want = hard_negatives(ref.gumbel_topk(q, 7, GOLD, 11, KEYS), 7)
    assert hard.version == v and hard.truncation is None
    assert torch.equal(hard.negatives.ids, want.ids), "the same Gumbel sample, bit for bit"
    # log_z is a logsumexp of per-shard logsumexps here, of all rows there: equal up to rounding.
    torch.testing.assert_close(hard.negatives.log_q, want.log_q, rtol=0, atol=1e-5)
    assert hard.negatives.hard.all() and not (hard.negatives.ids == GOLD[:, None]).any()

    mixed = service.mine(q, GOLD, n_hard=5, n_random=4, seed=11, query_keys=KEYS, p_mixed=50).result()
    want = mixed_negatives(ref.gumbel_topk(q, 5, GOLD, 11, KEYS), N, 9, 50, GOLD, 11,
                           random_scores_fn=lambda ids: ref.score_rows(q, ids))
    assert torch.equal(mixed.negatives.ids, want.ids) and torch.equal(mixed.negatives.hard, want.hard)
    torch.testing.assert_close(mixed.negatives.log_q, want.log_q, rtol=0, atol=1e-6)
    assert mixed.negatives.hard.sum(1).tolist() == [5] * 6  # p=50 of K-1=9: 4.5 rounds up

    rand = service.mine(q, GOLD, n_hard=0, n_random=20, seed=5, query_keys=KEYS).result()
    assert rand.version == -1 and rand.negatives.ids.shape == (6, 20) and not rand.negatives.hard.any()
    eligible = (N - (GOLD >= 0).long()).double()  # a mention without a gold excludes nothing
    torch.testing.assert_close(rand.negatives.log_q, (-eligible.log())[:, None].expand(6, 20).float())
    for neg in (hard.negatives, mixed.negatives, rand.negatives):
        for row, g in zip(neg.ids.tolist(), GOLD.tolist()):
            assert len(set(row)) == len(row) and g not in row and all(0 <= r < N for r in row)

    # The sampler seam: each mode's sampler drawn from the service answers what mine() answers.
    for mode, p, args, kwargs in (("hard", 50, (7, 0, 11), {}), ("mixed", 50, (5, 4, 11), {"p_mixed": 50}),
                                  ("random", 50, (0, 20, 5), {})):
        drawn = service.draw(sampler_for(mode, sum(args[:2]), p), q, GOLD, args[2], KEYS).result()
        mined = service.mine(q, GOLD, *args, query_keys=KEYS, **kwargs).result()
        assert torch.equal(drawn.negatives.ids, mined.negatives.ids) and drawn.version == mined.version
        assert torch.equal(drawn.negatives.log_q, mined.negatives.log_q)


def test_even_ranges_on_a_grid():
    assert even_ranges(150, 2, 16) == [(0, 80), (80, 150)]
    assert even_ranges(1000, 3, 128) == [(0, 384), (384, 640), (640, 1000)]
    assert even_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]  # grid 1: sizes differ by at most one
    for n, parts, grid in ((150, 2, 16), (1000, 7, 32), (5000, 4, 1000)):
        ranges = even_ranges(n, parts, grid)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a % grid == 0 and a < b for a, b in ranges)
        assert all(b == a2 for (_, b), (a2, _) in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="cannot be split into 3 non-empty ranges on a grid of 64"):
        even_ranges(100, 3, 64)


def test_a_block_sampler_service_equals_flat_bit_for_bit(ray_local, store_dir, tiny_model_dir, states,
                                                         tmp_path):
    # N = 150 is not a multiple of block_rows = 16, and the even split (75) is off the grid:
    # the service must put its boundary on the grid (80) for the flat draw to be reproduced.
    index = IndexConfig(backend="torch", chunk_rows=CHUNK, sampler="block", block_rows=16)
    config = ServiceConfig(num_shards=S, num_cpus=0.5, encode_batch_size=16, encode_dtype="fp32",
                           call_timeout_s=120.0, index=index)
    retriever = RetrieverConfig(preset="dual", mention_model=tiny_model_dir, storage_dtype="float32")
    service = NegativeService.create(store_dir, retriever, config, str(tmp_path))
    try:
        assert service.ranges == [(0, 80), (80, 150)]
        v = service.ensure_encoded(states[0])
        parts = [PersistedVersions(tmp_path / "shards" / shard_dir_name(i, S), {}).load(v)[0] for i in range(S)]
        ref = ShardIndex(ScoreSpec.preset("dual"), Reps(torch.cat([p.vecs for p in parts])), 0, index, v)
        q = queries(7)
        want = ref.gumbel_topk(q, 9, GOLD, 11, KEYS)
        parts = ray.get([h.gumbel_topk.remote(q, 9, GOLD, 11, KEYS) for h in service._handles])
        merged = merge_results(parts, 9)
        assert torch.equal(merged.ids, want.ids) and torch.equal(merged.scores, want.scores)
        assert torch.equal(merged.keys, want.keys)
        mined = service.mine(q, GOLD, n_hard=9, n_random=0, seed=11, query_keys=KEYS).result()
        hard = hard_negatives(want, 9)
        assert torch.equal(mined.negatives.ids, hard.ids)
        # log_z sums the same block masses in another order (per shard, then across): float64
        # ulps apart, which the float32 log-probabilities do not see.
        assert torch.equal(mined.negatives.log_q, hard.log_q)
        torch.testing.assert_close(merged.log_z, want.log_z, rtol=1e-13, atol=0)
        # the even, off-grid split draws another (equally exact) sample: what the grid is for
        off = [ShardIndex(ScoreSpec.preset("dual"), Reps(ref.entities.vecs[a:b]), a, index, v)
               for a, b in even_ranges(N, S)]
        assert not torch.equal(merge_results([p.gumbel_topk(q, 9, GOLD, 11, KEYS) for p in off], 9).ids, want.ids)
    finally:
        service.shutdown()


def test_many_requests_in_flight_give_the_sequential_answers(run):
    service, _ = run
    futures = [service.mine(queries(s), GOLD, 5, 0, seed=s, query_keys=KEYS) for s in range(6)]
    ready = [f.ready() for f in futures]  # never blocks
    assert all(isinstance(r, bool) for r in ready)
    got = [f.result(timeout=120) for f in reversed(futures)][::-1]
    for s, res in enumerate(got):
        again = service.mine(queries(s), GOLD, 5, 0, seed=s, query_keys=KEYS).result()
        assert torch.equal(res.negatives.ids, again.negatives.ids)
    assert all(f.ready() for f in futures)


@pytest.mark.parametrize("call,match", [
    (lambda s: s.mine(torch.randn(6, 16), GOLD, 3, 0, 1, KEYS), r"\[B, 32\].*float32 \[6, 16\]"),
    (lambda s: s.mine(torch.randn(6, 2, 32), GOLD, 3, 0, 1, KEYS), r"\[B, 32\]"),
    (lambda s: s.mine(torch.ones(6, 32, dtype=torch.int64), GOLD, 3, 0, 1, KEYS), "floating"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD.int(), 3, 0, 1, KEYS), r"gold must be an int64 tensor \[B\]"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD[:5], 3, 0, 1, KEYS), "B=6"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD + 10, 3, 0, 1, KEYS), r"gold values must be in \[-1, 150\)"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD, 3, 0, 1, KEYS[:, None]), r"query_keys must be .*\[B\]"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD, -1, 3, 1, KEYS), "n_hard must be an int >= 0"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD, 0, 0, 1, KEYS), "1 <= K-1"),
    (lambda s: s.mine(torch.randn(6, 32), GOLD, 3, 3, 1, KEYS, p_mixed=90), "p_mixed=90 gives 5 hard"),
    (lambda s: s.topk(torch.randn(6, 32), 0), "k must be an int"),
    (lambda s: s.refresh({"spec": {}}, 1), "hidden size None"),
])
def test_bad_input_is_refused_before_reaching_the_shards(run, call, match):
    service, _ = run
    with pytest.raises(ValueError, match=match):
        call(service)


def test_the_service_pickles_and_works_inside_a_ray_task(run):
    service, _ = run
    blob = pickle.dumps(service)
    assert len(blob) < 20_000, "only handles and small metadata"

    @ray.remote(num_cpus=0)
    def worker_mines(svc, q):
        return svc.mine(q, GOLD, 5, 0, seed=2, query_keys=KEYS).result().negatives.ids

    q = queries(3)
    got = ray.get(worker_mines.remote(service, q))
    assert torch.equal(got, service.mine(q, GOLD, 5, 0, seed=2, query_keys=KEYS).result().negatives.ids)


# --------------------------------------------------------------------------- versions


def test_answers_use_one_version_while_shards_disagree(run, states):
    service, run_dir = run
    v = service.version()
    q = queries(4)
    handles = service._handles
    # Shard 0 alone moves to v+1: answers stay on v (shard 0 is asked again for v).
    assert ray.get(handles[0].refresh.remote(states[v + 1], v + 1)) == v + 1
    assert service.version() == v
    assert_same(service.topk(q, 8, GOLD).result(), flat(run_dir, v).topk(q, 8, GOLD))
    assert service.refresh(states[v + 1], v + 1).wait() == v + 1
    flat(run_dir, v + 1)
    # Shard 0 moves two versions ahead, so it no longer holds the others' version: the
    # answer must then come from the newest one, once the others have reached it.
    for w in (v + 2, v + 3):
        ray.get(handles[0].refresh.remote(states[w], w))
    with pytest.raises(ray.exceptions.RayTaskError, match="does not hold version"):
        ray.get(handles[0].topk.remote(q, 8, GOLD, version=v + 1))
    pending = service.refresh(states[v + 3], v + 3)
    answer = service.topk(q, 8, GOLD).result()
    pending.wait()
    assert answer.version == v + 3
    assert_same(answer, flat(run_dir, v + 3).topk(q, 8, GOLD))


def test_a_refresh_during_queries_never_mixes_versions(run, states):
    service, run_dir = run
    v = service.version()
    flat(run_dir, v)
    q = queries(5)
    handle = service.refresh(states[v + 1], v + 1)
    seen = []
    while not handle.done():
        in_flight = [service.topk(q, 6, GOLD), service.mine(q, GOLD, 6, 0, seed=9, query_keys=KEYS)]
        seen.append((in_flight[0].result(), in_flight[1].result()))
    assert handle.wait() == v + 1
    seen.append((service.topk(q, 6, GOLD).result(), service.mine(q, GOLD, 6, 0, seed=9, query_keys=KEYS).result()))
    versions = [t.version for t, _ in seen]
    assert versions == sorted(versions), "versions only increase"
    assert set(versions) <= {v, v + 1} and versions[0] == v and versions[-1] == v + 1
    for top, mined in seen:
        ref = flat(run_dir, top.version)
        assert_same(top, ref.topk(q, 6, GOLD))
        want = hard_negatives(flat(run_dir, mined.version).gumbel_topk(q, 6, GOLD, 9, KEYS), 6)
        assert torch.equal(mined.negatives.ids, want.ids)


def test_a_mixed_answer_outlives_the_version_it_came_from(run, states):
    # A trainer prefetches: it reads a mixed-p answer after the shards have moved on by
    # keep_versions refreshes, which deletes the answer's version from memory and disk.
    service, run_dir = run
    v = service.version()
    ref = flat(run_dir, v)
    q = queries(7)
    future = service.mine(q, GOLD, n_hard=5, n_random=4, seed=3, query_keys=KEYS, p_mixed=50)
    while not future.ready():
        time.sleep(0.01)
    for w in (v + 1, v + 2, v + 3):
        assert service.refresh(states[w], w).wait() == w
    assert v not in set().union(*(set(s["held"]) | set(s["persisted"]) for s in service.status()))
    got = future.result()
    want = mixed_negatives(ref.gumbel_topk(q, 5, GOLD, 3, KEYS), N, 9, 50, GOLD, 3,
                           random_scores_fn=lambda ids: ref.score_rows(q, ids))
    assert got.version == v and torch.equal(got.negatives.ids, want.ids)
    torch.testing.assert_close(got.negatives.log_q, want.log_q, rtol=0, atol=1e-6)


def test_versions_of_another_model_in_the_shard_dir_are_never_served(run, states, store_dir, tiny_model_dir,
                                                                      tmp_path):
    import shutil

    service, run_dir = run
    shutil.copytree(run_dir / "shards", tmp_path / "shards")  # what a reused run.output_dir holds
    newest = max(max(s["persisted"]) for s in service.status())
    config = dataclasses.replace(service.config, shard_dir=str(tmp_path / "shards"))
    retriever = RetrieverConfig(preset="dual", mention_model=tiny_model_dir, storage_dtype="float32")

    # The same run restarted (same initial weights): its newest version is served, nothing encoded.
    again = NegativeService.create(store_dir, retriever, config, str(tmp_path))
    try:
        assert again.ensure_encoded(states[0]) == service.version()
        assert [s["encodes"] for s in again.status()] == [0, 0]
    finally:
        again.shutdown()

    # Another model over the same directory: encoded afresh, past every version there.
    other = NegativeService.create(store_dir, retriever, config, str(tmp_path))
    try:
        v = other.ensure_encoded(states[40])
        assert v == newest + 1 and [s["encodes"] for s in other.status()] == [1, 1]
        q = queries(8)
        assert_same(other.topk(q, 5, GOLD).result(), flat(tmp_path, v).topk(q, 5, GOLD))
        assert other.ensure_encoded(states[40]) == v and [s["encodes"] for s in other.status()] == [1, 1]
    finally:
        other.shutdown()


# --------------------------------------------------------------------------- failures


def wait_alive(service, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return service.status()
        except Exception:  # noqa: BLE001 - restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_shard_killed_during_mining_is_restarted_and_the_answer_is_still_right(run, states):
    service, run_dir = run
    v = service.version()
    q = queries(6)
    want = hard_negatives(flat(run_dir, v).gumbel_topk(q, 8, GOLD, 4, KEYS), 8)
    before = service.status()[1]
    futures = [service.mine(q, GOLD, 8, 0, seed=4, query_keys=KEYS) for _ in range(3)]
    ray.kill(service._handles[1], no_restart=False)
    futures += [service.mine(q, GOLD, 8, 0, seed=4, query_keys=KEYS) for _ in range(3)]  # sent to a dead shard
    for f in futures:
        got = f.result(timeout=300)
        assert got.version == v and torch.equal(got.negatives.ids, want.ids)
    after = wait_alive(service)[1]
    assert after["pid"] != before["pid"]
    assert (after["served"], after["source"], after["encodes"]) == (v, "reloaded", 0), "reloaded, not re-encoded"
    assert service.ensure_encoded(states[0]) == v and service.status()[1]["encodes"] == 0


def test_a_shard_killed_during_refresh_still_completes_it(run, states):
    service, run_dir = run
    v = service.version()
    q = queries(7)
    before = service.status()[0]
    handle = service.refresh(states[v + 1], v + 1)
    deadline = time.monotonic() + 120
    while True:  # wait until shard 0 is part-way through encoding
        st = ray.get(service._handles[0].status.remote())
        if st["refreshing"] == v + 1 and 0 < st["progress"][0] < st["progress"][1]:
            break
        assert time.monotonic() < deadline and not handle.done(), "never saw the refresh under way"
        time.sleep(0.002)
    ray.kill(service._handles[0], no_restart=False)
    assert handle.wait(timeout=300) == v + 1
    after = wait_alive(service)[0]
    assert after["pid"] != before["pid"] and after["served"] == v + 1
    assert_same(service.topk(q, 5, GOLD).result(), flat(run_dir, v + 1).topk(q, 5, GOLD))
