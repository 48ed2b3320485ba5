"""Evaluation retrieval against brute force: score every (mention, entity) pair, sort."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.index.config import IndexConfig
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from dist_nce.modeling.scoring import Reps, score_all
from dist_nce.retrieval import SnapshotPlan, build_local_index, plan_snapshot, retrieve, serve_model
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_kilt

N_ENTITIES = 80


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("retrieve_kb")
    src = write_kilt(root / "src", N_ENTITIES, 0, 23, 0, seed=3, missing_gold=0.1)
    prepare(PrepareConfig(out=str(root / "kb"), kilt_ks=str(src["kb"]), aida_dir=str(root / "src"),
                          model_dir=tiny_model_dir, entity_max_len=96, mention_max_len=40, progress=False),
            log=lambda _: None)
    return EntityStore(root / "kb"), MentionTable(root / "kb", "dev")


def make_retriever(model_dir: str, preset: str, m: int | None = None, seed: int = 0) -> Retriever:
    torch.manual_seed(seed)
    cfg = RetrieverConfig(preset=preset, m=m, mention_model=model_dir, storage_dtype="float32")
    r = Retriever.build(cfg).eval()
    # A random tiny BERT maps every text to nearly the same vector (scores equal to 1e-6);
    # noise on every weight spreads the scores so rankings are well defined.
    with torch.no_grad():
        for p in r.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return r


def brute_force(r: Retriever, store: EntityStore, mentions: MentionTable) -> np.ndarray:
    """[N, n] s(x, y) for every pair: all mentions and all entities in one batch each."""
    def encode(fn, ids, lengths):
        ids = torch.from_numpy(ids.astype(np.int64))
        with torch.no_grad():
            real = torch.arange(ids.shape[1])[None] < torch.tensor(np.asarray(lengths), dtype=torch.int64)[:, None]
            return fn(ids, real)
    rows = np.arange(len(store))
    e = encode(r.encode_entities, store.token_ids(rows), store.lengths(rows))
    x = encode(r.encode_mentions, mentions.token_ids(np.arange(len(mentions))), mentions.lengths)
    return score_all(r.spec, x, e).numpy()


def assert_ranking(got_rows, got_scores, brute: np.ndarray, allowed: np.ndarray, k: int) -> None:
    """got == the top k of ``brute`` over the ``allowed`` rows (score desc, row asc), -1 padded.

    Scores of separately batched encodings differ in the last bits, so positions whose
    brute-force score is within ``tol`` of a neighbour's may legitimately swap."""
    tol = 1e-4 + 2e-6 * float(np.abs(brute).max())  # SOM sums T dot products: scores in the hundreds
    checked = total = 0
    for i in range(brute.shape[0]):
        cand = np.flatnonzero(allowed)
        order = cand[np.lexsort((cand, -brute[i, cand]))][:k]
        want = np.full(k, -1)
        want[:len(order)] = order
        np.testing.assert_array_equal(got_rows[i] == -1, want == -1)
        real = want >= 0
        np.testing.assert_allclose(got_scores[i][real], brute[i, want[real]], atol=tol, rtol=0)
        np.testing.assert_allclose(brute[i, got_rows[i][real]], got_scores[i][real], atol=tol, rtol=0)
        s = brute[i, want[real]]
        gaps = np.diff(s)
        clear = np.ones(len(s), bool)
        clear[:-1] &= np.abs(gaps) > tol
        clear[1:] &= np.abs(gaps) > tol
        if len(order) < allowed.sum():  # the k-th place must also be clear of the first one left out
            nxt = brute[i, cand[np.lexsort((cand, -brute[i, cand]))][k]]
            clear[-1] &= s[-1] - nxt > tol
        np.testing.assert_array_equal(got_rows[i][real][clear], want[real][clear])
        checked, total = checked + clear.sum(), total + len(clear)
    assert checked > 0.9 * total, f"only {checked} of {total} ranks are clear of near-ties: a weak test"


def test_dual_flat_equals_brute_force(kb, tiny_model_dir):
    store, mentions = kb
    r = make_retriever(tiny_model_dir, "dual")
    index = build_local_index(r, store, progress=False)
    assert index.config.backend == "flat"
    got = retrieve(r, mentions, index, k=10, batch_size=7, progress=False)
    assert got.rows.shape == (len(mentions), 10) and got.versions == (0,)
    assert_ranking(got.rows, got.scores, brute_force(r, store, mentions), np.ones(len(store), bool), 10)


@pytest.mark.parametrize("preset,m", [("som", None), ("poly", 2), ("multi", 3)])
def test_union_of_range_indexes_equals_brute_force(kb, tiny_model_dir, preset, m):
    """Disjoint row-range indexes (torch backend; multi-m also through faiss) merged = the whole KB."""
    store, mentions = kb
    r = make_retriever(tiny_model_dir, preset, m)
    cfg = IndexConfig(backend="flat" if preset == "multi" else "torch", chunk_rows=16)
    parts = [build_local_index(r, store, cfg, rows=ab, batch_size=9, progress=False) for ab in [(0, 33), (33, 80)]]
    got = retrieve(r, mentions, parts, k=12, batch_size=5, progress=False)
    assert_ranking(got.rows, got.scores, brute_force(r, store, mentions), np.ones(len(store), bool), 12)


def test_restricted_range_pads_and_subset_keeps_order(kb, tiny_model_dir):
    store, mentions = kb
    r = make_retriever(tiny_model_dir, "dual")
    index = build_local_index(r, store, rows=(10, 25), progress=False)
    got = retrieve(r, mentions, index, k=20, batch_size=4, progress=False)
    allowed = np.zeros(len(store), bool)
    allowed[10:25] = True
    assert_ranking(got.rows, got.scores, brute_force(r, store, mentions), allowed, 20)
    assert (got.rows[:, 15:] == -1).all() and np.isneginf(got.scores[:, 15:]).all()
    sub = retrieve(r, mentions, index, k=20, indices=np.array([5, 2, 19]), batch_size=2, progress=False)
    np.testing.assert_array_equal(sub.rows, got.rows[[5, 2, 19]])


class _SlowFuture:
    def __init__(self, log, index, reps, k):
        self.log, self.index, self.reps, self.k = log, index, reps, k

    def result(self, timeout=None):
        self.log.append("result")
        return self.index.topk(self.reps, self.k)


class _StubService:
    """The NegativeService.topk contract (future with .result()) over an in-process index."""

    def __init__(self, index):
        self.index, self.log = index, []

    def topk(self, reps: Reps, k: int, gold=None):
        assert gold is None and reps.vecs.device.type == "cpu"
        self.log.append("submit")
        return _SlowFuture(self.log, self.index, reps, k)


def test_service_path_pipelines_requests_and_restores_order(kb, tiny_model_dir):
    store, mentions = kb
    r = make_retriever(tiny_model_dir, "dual")
    index = build_local_index(r, store, progress=False)
    service = _StubService(index)
    got = retrieve(r, mentions, service, k=8, batch_size=6, in_flight=2, progress=False)
    want = retrieve(r, mentions, index, k=8, batch_size=23, progress=False)
    np.testing.assert_array_equal(got.rows, want.rows)
    # 23 mentions / 6 per batch = 4 requests; a second one is sent before the first is collected.
    assert service.log == ["submit", "submit", "result", "submit", "result", "submit", "result", "result"]


def _status(served, fp, held=(), persisted=()):
    return {"served": served, "encoder_fingerprint": fp, "held": list(held), "persisted": list(persisted)}


def test_plan_snapshot_reuses_only_the_same_weights():
    fresh = [_status(-1, None), _status(-1, None)]
    assert plan_snapshot(fresh, "A") == SnapshotPlan(0, False)
    done = [_status(3, "A", [3], [2, 3]), _status(3, "A", [3], [3])]
    assert plan_snapshot(done, "A") == SnapshotPlan(3, True)
    # Another model's snapshot (a training run's newest version) is never served for this one.
    assert plan_snapshot(done, "B") == SnapshotPlan(4, False)
    # An interrupted encode of A as version 5: finish version 5 rather than start over.
    partial = [_status(5, "A", [5], [4, 5]), _status(4, "B", [4], [4])]
    assert plan_snapshot(partial, "A") == SnapshotPlan(5, False)
    # ... but a newer version of other weights anywhere means a new version.
    assert plan_snapshot([_status(5, "A", [5]), _status(4, "B", [4], [4, 6])], "A") == SnapshotPlan(7, False)


@pytest.mark.ray
@pytest.mark.slow
def test_negative_service_equals_brute_force_and_reuses_snapshot(ray_local, kb, tiny_model_dir, tmp_path):
    """A real local Ray: 2 shards; top-k through NegativeService.topk == brute force; the same
    model is served again without encoding, another model gets a new version."""
    from dist_nce.actors.config import ServiceConfig
    from dist_nce.actors.service import NegativeService

    store, mentions = kb
    r = make_retriever(tiny_model_dir, "dual")
    cfg = ServiceConfig(num_shards=2, num_cpus=0.5, encode_dtype="fp32", shard_dir=str(tmp_path / "shards"),
                        encode_batch_size=16)
    service = NegativeService.create(str(store.path), r.config, cfg, str(tmp_path))
    try:
        assert serve_model(service, r, progress=False) == SnapshotPlan(0, False)
        got = retrieve(r, mentions, service, k=10, batch_size=7, progress=False)
        assert got.versions == (0,)
        assert_ranking(got.rows, got.scores, brute_force(r, store, mentions), np.ones(len(store), bool), 10)
        # Same weights again: nothing to encode. (A fresh service reloading the persisted
        # snapshot is the job's test: tests/jobs/test_evaluate_kilt_aida.py.)
        assert serve_model(service, r, progress=False) == SnapshotPlan(0, True)
        assert [s["encodes"] for s in service.status()] == [1, 1]
        other = make_retriever(tiny_model_dir, "dual", seed=1)
        assert serve_model(service, other, progress=False) == SnapshotPlan(1, False)
        assert retrieve(other, mentions, service, k=10, progress=False).versions == (1,)
    finally:
        service.shutdown()
