"""A running NegativeService takes KB deltas (real local Ray, 2 shards, real prepared stores).

References: (1) one flat index over the delta'd row space built from the shards' own
persisted embeddings of the version an answer reports (bit for bit, as tests/index/
test_service.py does); (2) a store prepared FROM SCRATCH with the final entity set and
encoded with the same weights (by source id and score).
"""
from __future__ import annotations

import json
import random
import threading
import time

import pytest
import ray
import torch

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.service import NegativeService
from dist_nce.index.config import IndexConfig
from dist_nce.index.encode import encode_rows
from dist_nce.index.live import LiveIndex
from dist_nce.index.search import ShardIndex
from dist_nce.index.versions import PersistedVersions, shard_dir_name, version_dir_name
from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling.negatives import hard_negatives
from kb.delta import UpdateConfig, update
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore

from tests.actors.test_service import wait_alive  # noqa: E402
from tests.actors.test_shard import D, WORDS, entity_state  # noqa: E402  (tests/index is on sys.path)

pytestmark = pytest.mark.ray

N, S, CHUNK = 150, 2, 32
CONFIG = IndexConfig(backend="torch", chunk_rows=CHUNK)


def kilt_lines(ids, seed: int, prefix: str = "") -> dict[int, str]:
    rng = random.Random(seed)
    out = {}
    for wid in ids:
        title = f"{prefix}{rng.choice(WORDS).title()} {wid}"
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))
        out[wid] = json.dumps({"_id": str(wid), "wikipedia_id": str(wid), "wikipedia_title": title,
                               "text": [title + "\n", body + "\n"], "anchors": [], "categories": "", "history": {}})
    return out


def write(path, lines) -> str:
    path.write_text("".join(v + "\n" for v in lines.values()))
    return str(path)


def prepare_store(path, lines, model_dir) -> str:
    src = write(path.with_suffix(".json"), lines)
    prepare(PrepareConfig(out=str(path), kilt_ks=src, model_dir=model_dir, entity_max_len=24, rows_per_part=40,
                          progress=False), log=lambda s: None)
    return str(path)


class Kb:
    """The store under test and the entity set it should hold."""

    def __init__(self, root, model_dir):
        self.root, self.model_dir = root, model_dir
        self.lines = kilt_lines(range(1000, 1000 + N), seed=3)
        self.store = prepare_store(root / "store", self.lines, model_dir)
        self.deltas = 0

    def change(self, remove=(), add=None):
        """One kb.delta run: remove ids, add (or replace) {id: line}."""
        self.deltas += 1
        cfg = {"store": self.store, "model_dir": self.model_dir, "progress": False}
        if remove:
            (self.root / f"rm{self.deltas}.txt").write_text("".join(f"{w}\n" for w in remove))
            cfg["remove"] = str(self.root / f"rm{self.deltas}.txt")
        if add:
            cfg["add"] = [write(self.root / f"add{self.deltas}.json", add)]
        update(UpdateConfig(**cfg), log=lambda s: None)
        for w in remove:
            del self.lines[w]
        self.lines.update(add or {})

    def scratch(self) -> str:
        return prepare_store(self.root / f"scratch{self.deltas}", self.lines, self.model_dir)


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    return Kb(tmp_path_factory.mktemp("live_kb"), tiny_model_dir)


@pytest.fixture(scope="module")
def states(tiny_model_dir):
    return [entity_state(tiny_model_dir, noise=0.03 * v, seed=v) for v in range(2)]


@pytest.fixture(scope="module")
def run(ray_local, kb, tiny_model_dir, states, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("live_run")
    config = ServiceConfig(num_shards=S, num_cpus=0.5, encode_batch_size=1, encode_dtype="fp32", keep_versions=3,
                           max_concurrency=4, call_timeout_s=120.0, index=CONFIG)
    retriever = RetrieverConfig(preset="dual", mention_model=tiny_model_dir, storage_dtype="float32")
    service = NegativeService.create(kb.store, retriever, config, str(run_dir))
    assert service.ensure_encoded(states[0]) == 0
    yield service, run_dir
    service.shutdown()


def flat(service, run_dir, kb, version: int) -> LiveIndex:
    """One index over the whole row space from the shards' persisted embeddings of ``version``,
    with the rows removed at that version's KB version."""
    vecs = torch.full((service.num_entities, D), float("nan"))
    kb_versions = set()
    for i in range(S):
        pv = PersistedVersions(run_dir / "shards" / shard_dir_name(i, S), {})
        m = pv.manifest(version)
        kb_versions.add(m.get("kb_version", 0))
        a, b = m["rows"]
        vecs[a:b] = pv.load(m["base_in"])[0].vecs
        for p in m.get("pieces", []):
            vecs[p["rows"][0]:p["rows"][1]] = pv.load_piece(p).vecs
    assert not torch.isnan(vecs).any() and len(kb_versions) == 1, "every row, one KB version"
    kb_version = kb_versions.pop()
    dead = torch.as_tensor(EntityStore(kb.store, kb_version=kb_version).tombstones)
    return LiveIndex([ShardIndex(ScoreSpec.preset("dual"), Reps(vecs), 0, CONFIG, version)], dead, version,
                     kb_version)


def queries(seed: int, batch: int = 6) -> torch.Tensor:
    return torch.randn(batch, D, generator=torch.Generator().manual_seed(seed))


KEYS = torch.arange(100, 106)


def check_against_flat(service, ref, q, gold):
    top = service.topk(q, 9, gold).result()
    want = ref.topk(q, 9, gold)
    assert top.version == ref.version and torch.equal(top.ids, want.ids) and torch.equal(top.scores, want.scores)
    hard = service.mine(q, gold, n_hard=7, n_random=0, seed=11, query_keys=KEYS).result()
    assert torch.equal(hard.negatives.ids, hard_negatives(ref.gumbel_topk(q, 7, gold, 11, KEYS), 7).ids)
    mixed = service.mine(q, gold, n_hard=5, n_random=4, seed=2, query_keys=KEYS).result()
    rand = service.mine(q, gold, n_hard=0, n_random=30, seed=3, query_keys=KEYS).result()
    for res in (top.ids, hard.negatives.ids, mixed.negatives.ids, rand.negatives.ids):
        assert not torch.isin(res, ref.dead).any(), "a removed entity was returned"
    live = service.live.num_live
    assert live == service.num_entities - ref.dead.numel()
    # N counts live rows only; a mention without a gold, or whose gold was removed, excludes none
    eligible = (live - (service.live.rank(gold) >= 0).long()).double()
    torch.testing.assert_close(rand.negatives.log_q, (-eligible.log())[:, None].expand_as(rand.negatives.log_q).float())
    lse = service.lse_grad(q).result()
    torch.testing.assert_close(lse.lse, ref.lse_grad(q).lse, rtol=0, atol=1e-5)


def check_against_scratch(service, kb, state):
    """Top-k by source id and score equals a store built from scratch with the final entity set."""
    scratch = EntityStore(kb.scratch())
    store = EntityStore(kb.store)
    enc = EntityEncoder.from_state(state)
    reps = encode_rows(enc, scratch, 4, torch.device("cpu"), None, "float32")
    ref = ShardIndex(ScoreSpec.preset("dual"), reps, 0, CONFIG)
    q = queries(9, 8)
    got = service.topk(q, 12).result()
    want = ref.topk(q, 12)
    assert [store.source_ids(r) for r in got.ids.tolist()] == [scratch.source_ids(r) for r in want.ids.tolist()]
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)  # encoded in other batches


def test_deltas_are_served_live_and_equal_a_scratch_store(run, kb, states):
    service, run_dir = run
    q = queries(1)
    v0 = service.version()
    replaced = kilt_lines([1077, 1003], seed=9, prefix="Renamed ")
    kb.change(remove=[1003, 1040, 1077, 1100, 1149], add={**kilt_lines(range(5000, 5021), seed=4), **replaced})
    v1 = service.apply_delta()
    assert v1 == v0 + 1 and service.kb_version == 1 and service.num_entities == N + 23
    status = service.status()
    assert {s["kb_version"] for s in status} == {1} and {s["served"] for s in status} == {v1}
    assert sorted(r for s in status for a, b in s["pieces"] for r in range(a, b)) == list(range(N + 23))
    ref = flat(service, run_dir, kb, v1)
    store = EntityStore(kb.store)
    gold = torch.as_tensor(store.rows_for_source_ids(["1000", "5003", "1003", "1077", "1149", "1020"]))
    assert gold[4] == -1 and gold[2] >= N  # removed for good; replaced: a new row
    check_against_flat(service, ref, q, gold)
    check_against_scratch(service, kb, states[0])

    # a second delta: removals only (no row to encode), then more rows
    kb.change(remove=[5003, 1020])
    v2 = service.apply_delta()
    check_against_flat(service, flat(service, run_dir, kb, v2), q, gold)
    check_against_scratch(service, kb, states[0])


def test_a_full_refresh_covers_the_added_rows(run, kb, states):
    service, run_dir = run
    v = service.version()
    handle = service.refresh(states[1], v + 1, wait=True)
    assert handle.wait() == v + 1
    status = service.status()
    assert {s["kb_version"] for s in status} == {service.kb_version}
    ref = flat(service, run_dir, kb, v + 1)  # every piece re-encoded into the new version's directory
    for i in range(S):
        m = PersistedVersions(run_dir / "shards" / shard_dir_name(i, S), {}).manifest(v + 1)
        assert m["base_in"] == v + 1 and all(p["in"] == v + 1 for p in m["pieces"])
    check_against_flat(service, ref, queries(2), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_scratch(service, kb, states[1])




def restarted(service, shard: int, pid: int) -> dict:
    """Kill ``shard`` (Ray restarts it); its status once a new process (not ``pid``) answers."""
    ray.kill(service._handles[shard], no_restart=False)
    deadline = time.monotonic() + 120
    while (st := wait_alive(service)[shard])["pid"] == pid:  # the kill is asynchronous
        assert time.monotonic() < deadline, "the shard was not restarted"
        time.sleep(0.1)
    return st


def test_a_shard_killed_during_a_delta_recovers_to_a_consistent_version(run, kb, states):
    service, run_dir = run
    v = service.version()
    kb.change(remove=[1001], add=kilt_lines(range(6000, 6480), seed=6))
    before = service.status()[0]
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("v", service.apply_delta()))
    worker.start()
    deadline = time.monotonic() + 120
    # Wait until shard 0 is inside the delta (encoding or persisting its new rows). Not "part-way
    # through encoding" only: on 2 busy cores one status round trip can outlast a shard's whole
    # encode, and the test then saw the delta finish instead (a failed fresh-clone run).
    while True:
        st = ray.get(service._handles[0].status.remote())
        if st["refreshing"] == v + 1:
            break
        assert time.monotonic() < deadline and worker.is_alive(), "never saw the delta under way"
        time.sleep(0.002)
    ray.kill(service._handles[0], no_restart=False)
    worker.join(300)
    assert result["v"] == v + 1
    after = wait_alive(service)[0]
    assert after["pid"] != before["pid"] and (after["served"], after["kb_version"]) == (v + 1, service.kb_version)
    check_against_flat(service, flat(service, run_dir, kb, v + 1), queries(3), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_scratch(service, kb, states[1])
    # a shard restarted while idle reloads the same consistent version
    idle = service.status()[1]
    st = restarted(service, 1, idle["pid"])
    assert (st["served"], st["kb_version"], st["source"]) == (v + 1, service.kb_version, "reloaded")
    assert st["pieces"] == idle["pieces"] and st["live"] == idle["live"]
    check_against_flat(service, flat(service, run_dir, kb, v + 1), queries(4), torch.tensor([0, 1, 2, 3, 4, 5]))


def one_encoding_per_version(service) -> None:
    """Every version number that shards hold names one encoding: the same weights on every shard."""
    lineage = [ray.get(h.lineage.remote()) for h in service._handles]
    for version in set().union(*lineage):
        encoders = {held[version]["encoder"] for held in lineage if version in held}
        assert len(encoders) == 1, f"version {version} names {len(encoders)} encodings across the shards"


def test_deltas_and_refreshes_are_numbered_and_served_in_one_order(run, kb, states):
    """The driver's deltas and a trainer's refreshes go through one sequencer (actors.sequencer). A trainer
    whose book knows only version v used to publish v + 1, the number a delta had just taken: shards
    re-encoded over it while the others still served the delta's encoding under the same number."""
    service, run_dir = run
    v = service.version()
    kb.change(add=kilt_lines(range(8000, 8010), seed=10))
    d = service.apply_delta()
    assert d == v + 1
    refresh = service.refresh(states[0], after=v)  # a trainer that never heard of the delta
    assert refresh.version == d + 1 and refresh.wait() == d + 1
    # Both at once, from two callers: a refresh in flight while the driver serves another delta. The delta
    # is numbered after it and applied once it is served, with its weights.
    kb.change(remove=[1005], add=kilt_lines(range(8100, 8105), seed=11))
    refresh = service.refresh(states[1], after=d + 1)
    delta = {}
    driver = threading.Thread(target=lambda: delta.setdefault("v", service.apply_delta()))
    driver.start()
    assert refresh.wait() == refresh.version == d + 2
    driver.join(300)
    assert delta["v"] == d + 3 and {s["served"] for s in service.status()} == {d + 3}
    one_encoding_per_version(service)
    check_against_flat(service, flat(service, run_dir, kb, d + 3), queries(8), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_scratch(service, kb, states[1])


def test_a_delta_one_shard_cannot_take_is_applied_on_none_then_on_all_when_it_can(run, kb, states):
    """A restarted shard holds no encoder: a delta given other weights cannot be encoded there. Every shard is
    asked first, so it is applied on none (it used to be applied on the others, leaving the shards on two KB
    versions, and a later refresh mixed them under one number). Asked again with the weights served, it is
    served everywhere under one new number."""
    service, run_dir = run
    v = service.version()
    idle = service.status()[1]
    st = restarted(service, 1, idle["pid"])
    assert st["encoder_held"] is None and st["served"] == v
    kb.change(add=kilt_lines(range(8200, 8208), seed=12))
    with pytest.raises(Exception, match=r"refused by shard\(s\) \[1\], applied on none.*weights of the version served"):
        service.apply_delta(entity_state=states[0])
    status = service.status()
    assert [s["served"] for s in status] == [v, v] and {s["kb_version"] for s in status} == {service.kb_version}
    d = service.apply_delta(entity_state=states[1])
    status = service.status()
    assert d > v and {s["served"] for s in status} == {d} and {s["kb_version"] for s in status} == {service.kb_version}
    one_encoding_per_version(service)
    check_against_flat(service, flat(service, run_dir, kb, d), queries(9), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_scratch(service, kb, states[1])


def test_a_delta_that_fails_on_one_shard_after_its_checks_is_rolled_back_on_every_shard(run, kb, states):
    """A delta every shard accepted, then one could not persist (a broken or full disk: here a file where its
    version directory goes): every shard serves the version before it again, and a restart reloads that one.
    It used to stay applied on the others, the shards on two KB versions, and the next refresh re-encoded
    each shard's own KB under one number (outside review). Asked again once the disk is fixed, it is served
    everywhere under one new number."""
    service, run_dir = run
    v, kb_version = service.version(), service.kb_version
    kb.change(add=kilt_lines(range(8400, 8406), seed=14))
    blockers = [run_dir / "shards" / shard_dir_name(1, S) / version_dir_name(n) for n in range(v + 1, v + 9)]
    for b in blockers:
        b.write_text("not a version directory")
    with pytest.raises(Exception, match=r"failed on shard\(s\) \[1\], done on \[0\], rolled back to version "
                                        rf"{v} on every shard"):
        service.apply_delta(entity_state=states[1])
    status = service.status()
    assert [s["served"] for s in status] == [v, v] and {s["kb_version"] for s in status} == {kb_version}
    assert service.kb_version == kb_version
    st = restarted(service, 0, status[0]["pid"])  # shard 0 persisted the delta's version: not served again
    assert (st["served"], st["kb_version"]) == (v, kb_version)
    for b in blockers:
        b.unlink()
    d = service.apply_delta(entity_state=states[1])
    status = service.status()
    assert d > v + 1 and {s["served"] for s in status} == {d}
    assert {s["kb_version"] for s in status} == {service.kb_version} == {EntityStore(kb.store).kb_version}
    one_encoding_per_version(service)
    check_against_flat(service, flat(service, run_dir, kb, d), queries(11), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_scratch(service, kb, states[1])


def test_a_delta_asked_for_after_a_trainer_went_back_to_an_older_version_is_applied(run, kb, states):
    """A resumed trainer serves its checkpoint's index version again (use_version, from its own copy of the
    service), which may hold an older KB version. The driver's copy then still believed the newer one served:
    asked for it again, it answered at once that it was, and served nothing."""
    service, run_dir = run
    before = service.version()
    kb.change(add=kilt_lines(range(8300, 8304), seed=13))
    assert service.apply_delta() == before + 1 and service.kb_version == EntityStore(kb.store).kb_version
    trainer = ray.cloudpickle.loads(ray.cloudpickle.dumps(service))  # a Ray Train worker's copy
    assert trainer.use_version(before)
    assert {s["served"] for s in service.status()} == {before} and trainer.kb_version == service.kb_version - 1
    again = service.apply_delta()
    status = service.status()
    assert again == before + 2 and {s["served"] for s in status} == {again}
    assert {s["kb_version"] for s in status} == {EntityStore(kb.store).kb_version}
    one_encoding_per_version(service)
    check_against_flat(service, flat(service, run_dir, kb, again), queries(10), torch.tensor([0, 1, 2, 3, 4, 5]))


def test_services_created_on_a_changed_store(run, kb, states, tiny_model_dir, tmp_path_factory):
    """A fresh run on the changed store serves its current version (the version-0 rows, then only the
    added ones); a driver restarted on the same shard directory reloads the delta'd version as is."""
    service, run_dir = run
    config, retriever = service.config, RetrieverConfig(preset="dual", mention_model=tiny_model_dir,
                                                        storage_dtype="float32")
    current = EntityStore(kb.store).kb_version
    fresh_dir = tmp_path_factory.mktemp("fresh_run")
    fresh = NegativeService.create(kb.store, retriever, config, str(fresh_dir))
    try:
        v = fresh.ensure_encoded(states[1])
        assert fresh.kb_version == current and fresh.ranges == service.ranges
        check_against_flat(fresh, flat(fresh, fresh_dir, kb, v), queries(5), torch.tensor([0, 1, 2, 3, 4, 5]))
        check_against_scratch(fresh, kb, states[1])
    finally:
        fresh.shutdown()
    served = service.version()
    service.shutdown()  # the driver goes away; its shards' versions stay on disk
    restarted = NegativeService.create(kb.store, retriever, config, str(run_dir))
    try:
        assert restarted.version() == served, "the run's newest version, reloaded"
        status = restarted.status()
        assert {s["kb_version"] for s in status} == {current} and not any(s["encodes"] for s in status)
        assert restarted.kb_version == current and restarted.num_entities == EntityStore(kb.store).num_entities
        check_against_flat(restarted, flat(restarted, run_dir, kb, served), queries(6), torch.tensor([0, 1, 2, 3, 4, 5]))
    finally:
        restarted.shutdown()


def test_a_restarted_service_holds_its_encoders_before_the_first_delta(ray_local, tiny_model_dir, states,
                                                                       tmp_path_factory):
    """Shards reloaded from disk build the encoder of the weights they serve when the driver
    hands them over (ensure_encoded), in the background, so the first delta only encodes rows."""
    from dist_nce.index.encode import state_fingerprint

    kb = Kb(tmp_path_factory.mktemp("restart_kb"), tiny_model_dir)
    run_dir = tmp_path_factory.mktemp("restart_run")
    config = ServiceConfig(num_shards=S, num_cpus=0.5, encode_batch_size=1, encode_dtype="fp32", keep_versions=3,
                           call_timeout_s=120.0, index=CONFIG)
    retriever = RetrieverConfig(preset="dual", mention_model=tiny_model_dir, storage_dtype="float32")
    first = NegativeService.create(kb.store, retriever, config, str(run_dir))
    assert first.ensure_encoded(states[0]) == 0
    first.shutdown()
    service = NegativeService.create(kb.store, retriever, config, str(run_dir))
    try:
        assert service.ensure_encoded(states[0]) == 0
        fp, deadline = state_fingerprint(states[0]), time.monotonic() + 120
        while {s["encoder_held"] for s in service.status()} != {fp}:
            assert time.monotonic() < deadline, "the reloaded shards never built their encoder"
            time.sleep(0.1)
        assert not any(s["encodes"] for s in service.status()) and {s["source"] for s in service.status()} == {
            "reloaded"}
        kb.change(remove=[1002, 1090], add=kilt_lines(range(7000, 7040), seed=8))
        v = service.apply_delta()
        assert v == 1 and {s["kb_version"] for s in service.status()} == {1}
        check_against_flat(service, flat(service, run_dir, kb, v), queries(7), torch.tensor([0, 1, 2, 3, 4, 5]))
        check_against_scratch(service, kb, states[0])
    finally:
        service.shutdown()
