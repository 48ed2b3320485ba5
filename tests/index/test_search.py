"""Shard search (dist_nce.index.search) against flat brute force on deterministic data."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dist_nce.cluster.runtime import configure_faiss
from dist_nce.index import faiss_backend
from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import exact_search
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec, score_all
from dist_nce.sampling.negatives import sample_hard
from dist_nce.sampling.topk import merge_results

DUAL = ScoreSpec.preset("dual")
SPLITS = [(0, 37), (37, 38), (38, 120), (120, 200)]  # uneven, one single-row shard
# The block sampler's bit-for-bit layouts start on its block grid (4 rows here), not on the score grid.
BLOCK_SPLITS = [(0, 36), (36, 40), (40, 120), (120, 200)]


@pytest.fixture(autouse=True, scope="module")
def _faiss_blas():
    configure_faiss()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def clustered(n: int, d: int, clusters: int, noise: float, seed: int, scale: float = 1.0):
    """Vectors of norm ``scale`` around random unit centres, ``noise`` = the offsets' typical norm
    (recall tests need structure: iid vectors give ~0.1 recall@64)."""
    g = gen(seed)
    centres = torch.nn.functional.normalize(torch.randn(clusters, d, generator=g), dim=1)
    offsets = noise / d ** 0.5 * torch.randn(n, d, generator=g)
    x = centres[torch.randint(0, clusters, (n,), generator=g)] + offsets
    return scale * torch.nn.functional.normalize(x, dim=1), centres


def reference_topk(scores: torch.Tensor, k: int, gold: torch.Tensor) -> tuple[list, list]:
    """Python sort by (score desc, id asc) with the gold removed: the obvious reference."""
    gold = gold[:, None] if gold.dim() == 1 else gold
    ids, vals = [], []
    for b in range(scores.shape[0]):
        rows = [j for j in range(scores.shape[1]) if j not in gold[b].tolist()]
        rows.sort(key=lambda j: (-scores[b, j].item(), j))
        ids.append(rows[:k])
        vals.append([scores[b, j].item() for j in rows[:k]])
    return ids, vals


def shards(spec, ents: Reps, cfg: IndexConfig, splits=SPLITS) -> list[ShardIndex]:
    return [ShardIndex(spec, Reps(ents.vecs[a:b], None if ents.mask is None else ents.mask[a:b]), a, cfg)
            for a, b in splits]


@pytest.mark.parametrize("backend", ["torch", "flat"])
def test_sharded_topk_equals_flat_reference_with_ties(backend):
    e = torch.randn(200, 16, generator=gen(0))
    e[150] = e[20]  # exact duplicates across shard boundaries: the lower id must win
    e[60] = e[20]
    q = torch.randn(6, 16, generator=gen(1))
    q[0] = e[20] * 3  # the duplicated rows are the top hits of query 0
    gold = torch.tensor([-1, 3, 199, 0, 37, 120])
    cfg = IndexConfig(backend=backend, chunk_rows=23)
    merged = merge_results([s.topk(q, 10, gold) for s in shards(DUAL, Reps(e), cfg)], 10)
    want_ids, want_scores = reference_topk(q @ e.T, 10, gold)
    assert merged.ids.tolist() == want_ids
    torch.testing.assert_close(merged.scores, torch.tensor(want_scores), rtol=0, atol=1e-5)
    assert merged.ids[0, :3].tolist() == [20, 60, 150]


@pytest.mark.parametrize("sampler", ["dense", "block"])
@pytest.mark.parametrize("backend", ["torch", "flat", "ivf", "hnsw"])
def test_gold_never_returned_even_when_it_scores_highest(backend, sampler):
    e, _ = clustered(200, 16, 8, 0.3, seed=2)
    gold = torch.tensor([[5, 6], [100, -1], [199, 0]])
    q = e[gold[:, 0]] * 5  # the gold is each query's best match
    cfg = IndexConfig(backend=backend, nlist=8, nprobe=8, hnsw_m=8, candidates=40, tail_sample=50,
                      sampler=sampler, block_rows=8)
    for s in shards(DUAL, Reps(e), cfg, [(0, 200)]) + shards(DUAL, Reps(e), cfg, [(0, 100), (100, 200)]):
        for res in (s.topk(q, 12, gold), s.gumbel_topk(q, 12, gold, seed=1, query_keys=torch.arange(3))):
            assert not (res.ids[:, :, None] == gold[:, None, :]).any()
            assert (res.ids >= 0).all()


@pytest.mark.parametrize("sampler", ["dense", "block"])
@pytest.mark.parametrize("preset", ["dual", "som", "poly", "multi"])
def test_sharded_gumbel_equals_flat_bit_for_bit(preset, sampler):
    g = gen(3)
    spec = ScoreSpec.preset(preset, m=None if preset in ("dual", "som") else 4)
    if preset == "dual":
        m, ents = Reps(torch.randn(5, 8, generator=g)), Reps(torch.randn(200, 8, generator=g))
    elif preset == "som":
        mmask = torch.arange(6)[None] < torch.tensor([6, 3, 1, 4, 2])[:, None]
        emask = torch.arange(5)[None] < torch.randint(1, 6, (200,), generator=g)[:, None]
        m, ents = Reps(torch.randn(5, 6, 8, generator=g), mmask), Reps(torch.randn(200, 5, 8, generator=g), emask)
    elif preset == "multi":
        m, ents = Reps(torch.randn(5, 8, generator=g)), _multi_data(200, 4, 8, seed=3, near_duplicate=False)
    else:
        m, ents = Reps(torch.randn(5, 4, 8, generator=g)), Reps(torch.randn(200, 8, generator=g))
    gold, keys = torch.tensor([0, 199, 37, -1, 50]), torch.arange(5) + 1000
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler=sampler, block_rows=4)
    flat = ShardIndex(spec, ents, 0, cfg).gumbel_topk(m, 16, gold, 7, keys)
    step = 29 if sampler == "dense" else 28  # block: shards start on the 4-row block grid
    seven = [(a, min(a + step, 200)) for a in range(0, 200, step)]
    for layout in ((SPLITS if sampler == "dense" else BLOCK_SPLITS), seven):
        merged = merge_results([s.gumbel_topk(m, 16, gold, 7, keys) for s in shards(spec, ents, cfg, layout)], 16)
        assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    # another block size may change scores in the last ulp (BLAS), never the sample here
    other = ShardIndex(spec, ents, 0, IndexConfig(backend="torch", chunk_rows=9 if sampler == "dense" else 8,
                                                  sampler=sampler, block_rows=4)).gumbel_topk(m, 16, gold, 7, keys)
    assert torch.equal(other.ids, flat.ids)
    torch.testing.assert_close(other.keys, flat.keys, rtol=1e-6, atol=1e-6)
    scores = score_all(spec, m, ents).double()
    scores[torch.tensor([0, 1, 2, 4]), gold[[0, 1, 2, 4]]] = float("-inf")
    torch.testing.assert_close(merged.log_z, torch.logsumexp(scores, 1))
    torch.testing.assert_close(flat.log_z, merged.log_z)
    # and it is the flat sampler of negatives.py on the full score matrix
    ref = sample_hard(score_all(spec, m, ents).float(), 16, gold, 7, keys, sampler=sampler, block_rows=4)
    assert torch.equal(ref.ids, merged.ids)
    # a different seed gives a different sample
    assert not torch.equal(merge_results([s.gumbel_topk(m, 16, gold, 8, keys) for s in
                                          shards(spec, ents, IndexConfig(backend="torch", sampler=sampler,
                                                                         block_rows=4))], 16).ids, merged.ids)


def test_exact_topk_any_preset_equals_score_all():
    g = gen(4)
    spec = ScoreSpec.preset("som")
    m = Reps(torch.randn(3, 4, 8, generator=g), torch.arange(4)[None] < torch.tensor([[4], [2], [1]]))
    ents = Reps(torch.randn(50, 3, 8, generator=g), torch.arange(3)[None] < torch.randint(1, 4, (50, 1),
                                                                                          generator=g))
    res = exact_search(spec, m, ents, 100, 7, torch.tensor([101, -1, 149]), chunk_rows=11)
    want_ids, want_scores = reference_topk(score_all(spec, m, ents), 7, torch.tensor([1, -1, 49]))
    assert (res.ids - 100).tolist() == want_ids
    torch.testing.assert_close(res.scores, torch.tensor(want_scores))


def _inclusion(p: list[float], k: int) -> torch.Tensor:
    """Exact inclusion probabilities of k draws without replacement (successive sampling)."""
    pi = torch.zeros(len(p), dtype=torch.float64)
    for seq in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for i in seq:
            prob, left = prob * p[i] / left, left - p[i]
        pi[list(seq)] += prob
    return pi


# block: shards [0, 3) [3, 4) [4, 10) cut the 2-row blocks {2, 3} into pieces, each drawn as a
# block of its own; [0, 4) [4, 10) are on the grid.
@pytest.mark.parametrize("sampler,layout,score_dtype", [("dense", [(0, 3), (3, 4), (4, 10)], "fp32"),
                                                        ("block", [(0, 3), (3, 4), (4, 10)], "fp32"),
                                                        ("block", [(0, 4), (4, 10)], "fp32"),
                                                        ("dense", [(0, 3), (3, 10)], "bf16"),
                                                        ("block", [(0, 4), (4, 10)], "bf16")])
def test_sharded_gumbel_distribution_is_the_exact_law(sampler, layout, score_dtype):
    scores = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 0.8, -1.0, 1.2])
    ents = Reps(torch.diag(scores))  # entity i scores scores[i] against the all-ones query
    if score_dtype == "bf16":  # the law is that of the scores the index computes: bf16-rounded here
        scores = scores.bfloat16().float()
    draws = 100_000
    q, gold = torch.ones(draws, 10), torch.zeros(draws, dtype=torch.int64)
    cfg = IndexConfig(backend="torch", chunk_rows=4, sampler=sampler, block_rows=2, score_dtype=score_dtype)
    res = merge_results([s.gumbel_topk(q, 3, gold, 11, torch.arange(draws))
                         for s in shards(DUAL, ents, cfg, layout)], 3)
    assert torch.equal(res.scores[:, 0], scores[res.ids[:, 0]])
    pi = _inclusion(torch.softmax(scores[1:].double(), 0).tolist(), 3)
    freq = torch.stack([(res.ids == i + 1).any(1).double().mean() for i in range(9)])
    z = (freq - pi).abs() / torch.sqrt(pi * (1 - pi) / draws)
    assert float(z.max()) < 5.0


def _multi_data(n: int, m: int, d: int, seed: int, near_duplicate: bool):
    g = gen(seed)
    base = torch.randn(n, 1 if near_duplicate else m, d, generator=g)
    vecs = base.expand(n, m, d) + (0.01 if near_duplicate else 1.0) * torch.randn(n, m, d, generator=g)
    mask = torch.arange(m)[None] < torch.randint(1, m + 1, (n, 1), generator=g)
    mask[:, 0] = True
    return Reps(vecs.contiguous(), mask)


@pytest.mark.parametrize("near_duplicate", [False, True])  # True forces the fetch enlargement
@pytest.mark.parametrize("backend", ["torch", "flat"])
def test_multi_m_grouping_equals_bruteforce_max(backend, near_duplicate):
    spec = ScoreSpec.preset("multi", m=3)
    ents = _multi_data(120, 3, 8, seed=5, near_duplicate=near_duplicate)
    q = torch.randn(4, 8, generator=gen(6))
    sims = torch.einsum("bd,nmd->bnm", q, ents.vecs).masked_fill(~ents.mask[None], float("-inf"))
    brute = sims.amax(-1)  # max over each entity's real vectors
    gold = torch.tensor([0, 5, -1, 119])
    cfg = IndexConfig(backend=backend, chunk_rows=17)
    merged = merge_results([s.topk(q, 15, gold) for s in shards(spec, ents, cfg, [(0, 50), (50, 120)])], 15)
    want_ids, want_scores = reference_topk(brute, 15, gold)
    assert merged.ids.tolist() == want_ids
    torch.testing.assert_close(merged.scores, torch.tensor(want_scores), rtol=0, atol=1e-5)


def test_search_entities_enlarges_fetch_for_duplicates():
    import faiss

    vecs = torch.randn(10, 4, generator=gen(7)).repeat_interleave(5, dim=0)  # 5 copies per entity
    owners = torch.arange(10).repeat_interleave(5)
    index = faiss.IndexFlatIP(4)
    index.add(vecs.numpy())
    ents, scores = faiss_backend.search_entities(index, vecs[:2].numpy(), 6, owners,
                                                 torch.tensor([[0], [-1]]))
    brute = (vecs[:2] @ vecs[::5].T)
    brute[0, 0] = float("-inf")
    want = brute.topk(6, dim=1).indices
    assert torch.equal(ents, want)
    torch.testing.assert_close(scores, brute.gather(1, want))


def _recall(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(got.tolist(), want.tolist())]))


@pytest.mark.parametrize("backend,n", [("ivf", 4000), ("hnsw", 1000)])
def test_ann_recall_on_clustered_data(backend, n):
    e, centres = clustered(n, 32, 40, 0.35, seed=8)
    q, _ = clustered(64, 32, 40, 0.35, seed=9)
    cfg = IndexConfig(backend=backend, nlist=40, nprobe=6, hnsw_m=12, ef_construction=64, ef_search=64)
    got = ShardIndex(DUAL, Reps(e), 0, cfg).topk(q, 32)
    exact = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="flat")).topk(q, 32)
    assert _recall(got.ids, exact.ids) > 0.9


def test_candidates_mode_covering_every_row_is_the_exact_sample():
    e = torch.randn(150, 8, generator=gen(19))
    q, gold, qkeys = torch.randn(4, 8, generator=gen(20)), torch.tensor([1, 2, 3, -1]), torch.arange(4)
    # kernel torch: the candidates' top-k and the dense sample score rows with the same arithmetic (the
    # native top-k sums each score in its own order, a few ulps away); candidates mode adds one Gumbel per
    # candidate, so its exact twin is the dense sampler (the default, auto, is the block sampler here)
    exact = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", gumbel="exact", sampler="dense",
                                                     kernel="torch")).gumbel_topk(q, 9, gold, 5, qkeys)
    cand = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", gumbel="candidates", candidates=150,
                                                   tail_sample=150, kernel="torch")).gumbel_topk(q, 9, gold, 5, qkeys)
    assert torch.equal(cand.ids, exact.ids) and torch.equal(cand.keys, exact.keys)
    torch.testing.assert_close(cand.log_z, exact.log_z)
    assert torch.equal(cand.truncation(), torch.zeros(4, dtype=torch.float64)) and exact.truncation() is None


def test_index_config_from_yaml_dict():
    from dist_nce.core.config import ConfigError, from_dict

    cfg = from_dict(IndexConfig, {"backend": "ivf", "nprobe": 8, "gumbel": "auto"}, "configs/x.yaml")
    assert cfg.gumbel_mode() == "candidates" and IndexConfig(backend="flat").gumbel_mode() == "exact"
    with pytest.raises(ConfigError, match="nprobee: unknown key"):
        from_dict(IndexConfig, {"nprobee": 8}, "configs/x.yaml")
    with pytest.raises(ConfigError, match="bf16 is torch-only"):
        from_dict(IndexConfig, {"backend": "flat", "storage": "bf16"}, "configs/x.yaml")


def test_truncation_estimate_close_to_true_outside_mass():
    e, _ = clustered(2000, 16, 10, 0.5, seed=10, scale=4.0)
    q, _ = clustered(8, 16, 10, 0.5, seed=11, scale=4.0)
    gold, qkeys = torch.arange(8) * 3, torch.arange(8)
    full = (q @ e.T).double()
    full[torch.arange(8), gold] = float("-inf")
    indexes = {r: ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="ivf", nlist=20, nprobe=3, candidates=200,
                                                          tail_sample=r)) for r in (2000, 600, 300)}
    index = indexes[300]
    cand = index.topk(q, 200, gold).ids
    # IVF may return fewer than 200 (probed lists exhausted): -1 slots cover nothing
    inside = torch.zeros_like(full, dtype=torch.bool).scatter(1, cand.clamp(min=0), cand >= 0)
    out_sum = torch.logsumexp(full.masked_fill(inside, float("-inf")), 1)
    true_out = torch.exp(out_sum - torch.logsumexp(full, 1))
    assert 0.05 < float(true_out.min()) and float(true_out.max()) < 0.9  # a regime worth measuring

    def run(sample: int, seed: int):
        return indexes[sample].gumbel_topk(q, 10, gold, seed=seed, query_keys=qkeys)

    exact = run(2000, 3)  # every row sampled: the estimate is the exact outside mass
    torch.testing.assert_close(exact.truncation(), true_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(exact.log_z, torch.logsumexp(full.masked_fill(~inside, float("-inf")), 1))
    assert set(exact.ids.flatten().tolist()) <= set(cand.flatten().tolist())
    assert float((run(600, 3).truncation() - true_out).abs().max()) < 0.1
    # unbiased for the outside SUM: the mean over independent samples converges to it
    # with the estimator's exact standard error: (n / R) sum of R iid f(U), f = e^s outside
    f = torch.exp(full.masked_fill(inside, float("-inf")) - out_sum[:, None])  # scaled: true sum = 1
    se = 2000 * f.std(1, correction=0) / (300 * 40) ** 0.5
    ratios = torch.stack([torch.exp(run(300, s).tail_log_z - out_sum) for s in range(40)])
    z = (ratios.mean(0) - 1) / se
    assert float(z.abs().max()) < 4, z


def test_fp16_flat_within_tolerance_of_fp32():
    e, _ = clustered(500, 32, 10, 0.4, seed=12)
    q, _ = clustered(16, 32, 10, 0.4, seed=13)
    r32 = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="flat")).topk(q, 20)
    r16 = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="flat", storage="fp16")).topk(q, 20)
    true16 = q @ e.half().float().T  # exact scores of the fp16-rounded vectors
    # faiss SQfp16 decodes to the same fp16 values: equal to fp32 rounding
    torch.testing.assert_close(r16.scores, true16.gather(1, r16.ids), rtol=0, atol=1e-6)
    assert float((r16.scores - (q @ e.T).gather(1, r16.ids)).abs().max()) < 2e-3
    assert _recall(r16.ids, r32.ids) > 0.95


def test_bf16_compute_within_tolerance_of_fp32():
    e = torch.randn(300, 32, generator=gen(14)) / 6
    q = torch.randn(5, 32, generator=gen(15))
    r = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", compute="bf16")).topk(q, 10)
    # reference: one bf16 GEMM over the whole shard (torch's CPU bf16 matmul rounds its output to
    # bf16); the chunked search may sum in another order, so one bf16 ulp (2^-8 relative) apart
    ref = (q.bfloat16() @ e.bfloat16().T).float()
    torch.testing.assert_close(r.scores, ref.gather(1, r.ids), rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(r.scores, ref.topk(10).values, rtol=2 ** -8, atol=1e-6)  # its top 10
    # against fp32: inputs and output rounded to bf16, within 2^-7 of sum_i |q_i e_i|, and bf16 really ran
    true, magnitude = q @ e.T, q.abs() @ e.abs().T
    rel = (r.scores - true.gather(1, r.ids)).abs() / magnitude.gather(1, r.ids)
    assert float(rel.max()) <= 2 ** -7 and float(rel.max()) > 2 ** -12
    # no row left out beats a returned one by more than that tolerance
    tenth = true.topk(10).values[:, -1:]
    assert bool((true.gather(1, r.ids) >= tenth - 2 ** -6 * magnitude.gather(1, r.ids)).all())


def test_score_rows_equals_score_all():
    spec = ScoreSpec.preset("multi", m=3)
    ents = _multi_data(40, 3, 8, seed=16, near_duplicate=False)
    q = torch.randn(3, 8, generator=gen(17))
    idx = ShardIndex(spec, Reps(ents.vecs[10:], ents.mask[10:]), 10, IndexConfig(backend="torch"))
    rows = torch.tensor([[10, 39, 20], [11, 11, 12], [30, 31, 32]])
    want = score_all(spec, Reps(q), ents).gather(1, rows)
    torch.testing.assert_close(idx.score_rows(q, rows), want)
    with pytest.raises(ValueError, match=r"rows outside this shard \[10, 40\)"):
        idx.score_rows(q, torch.tensor([[0], [1], [2]]))


def test_bad_inputs_have_clear_errors():
    e = torch.randn(50, 8)
    idx = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch"))
    with pytest.raises(ValueError, match="last dim d=8"):
        idx.topk(torch.randn(2, 7), 3)
    with pytest.raises(ValueError, match=r"gold must be int64 \[B\] or \[B, e\] with B=2"):
        idx.topk(torch.randn(2, 8), 3, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"query_keys must be int64 \[B\] with B=2"):
        idx.gumbel_topk(torch.randn(2, 8), 3, None, 0, torch.arange(3))
    with pytest.raises(ValueError, match="k must be a positive int"):
        idx.topk(torch.randn(2, 8), 0)
    with pytest.raises(ValueError, match="entity reps must be floating"):
        ShardIndex(DUAL, Reps(torch.zeros(5, 8, dtype=torch.int64)), 0)
    with pytest.raises(ValueError, match=r"queries must be \[B, 8\]"):
        ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="flat")).topk(torch.randn(2, 3, 8), 3)
    with pytest.raises(ValueError, match="not one; use backend 'torch'"):
        ShardIndex(ScoreSpec.preset("som"), Reps(torch.randn(5, 3, 8)), 0, IndexConfig(backend="flat"))
    with pytest.raises(ValueError, match="bf16 is torch-only"):
        ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="flat", storage="bf16"))
    with pytest.raises(ValueError, match="nlist=64 needs at least"):
        ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="ivf", nlist=64))


def test_faiss_gpu_on_without_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr("dist_nce.cluster.runtime.faiss_has_gpu", lambda: False)
    with pytest.raises(ValueError, match="faiss_gpu is 'on' but faiss sees no GPU"):
        ShardIndex(DUAL, Reps(torch.randn(20, 8)), 0, IndexConfig(backend="flat", faiss_gpu="on"))


@pytest.mark.parametrize("backend,storage", [("flat", "fp16"), ("ivf", "fp32"), ("hnsw", "fp32")])
def test_faiss_gpu_path_is_selected_by_config(monkeypatch, backend, storage):
    """No GPU here: fake faiss's GPU entry points and check the real selection code uses them."""
    import faiss

    calls = []

    class Options:
        useFloat16 = False

    class Space:
        def set_index_parameter(self, index, name, value):
            calls.append((name, value))

    def cpu_to_gpu(res, device, index, options):
        calls.append(("clone", device, type(index).__name__, options.useFloat16))
        return index  # stands in for the GPU index

    monkeypatch.setattr("dist_nce.cluster.runtime.faiss_has_gpu", lambda: True)
    monkeypatch.setattr(faiss, "StandardGpuResources", lambda: object(), raising=False)
    monkeypatch.setattr(faiss, "GpuClonerOptions", Options, raising=False)
    monkeypatch.setattr(faiss, "GpuParameterSpace", Space, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", cpu_to_gpu, raising=False)
    e, _ = clustered(200, 8, 4, 0.3, seed=18)
    idx = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend=backend, storage=storage, faiss_gpu="on",
                                                   nlist=4, nprobe=2, hnsw_m=8))
    res = idx.topk(e[:3], 5)
    assert (res.ids >= 0).all()
    if backend == "hnsw":  # faiss has no GPU HNSW: it stays on the CPU
        assert calls == [] and not idx._on_gpu
    elif backend == "flat":
        assert calls == [("clone", 0, "IndexFlat", True)] and idx._on_gpu
    else:
        assert calls == [("clone", 0, "IndexIVFFlat", False), ("nprobe", 2)]


@pytest.mark.parametrize("backend,storage", [("flat", "fp32"), ("flat", "fp16"), ("hnsw", "fp32"), ("hnsw", "fp16")])
def test_cpu_flat_and_hnsw_hold_the_vectors_once(backend, storage):
    """The torch reps are a view of the faiss codes (no second copy), equal to the reps rounded
    to the storage dtype, and the exact paths read them as they read a private copy."""
    import gc

    import faiss

    e, _ = clustered(300, 16, 6, 0.4, seed=19, scale=3.0)
    q = torch.randn(4, 16, generator=gen(20))
    gold, keys = torch.tensor([0, 5, -1, 299]), torch.arange(4)
    cfg = IndexConfig(backend=backend, storage=storage, hnsw_m=8, chunk_rows=64, gumbel="exact")
    idx = ShardIndex(DUAL, Reps(e), 0, cfg)
    dtype = torch.float16 if storage == "fp16" else torch.float32
    codes = faiss.downcast_index(idx._faiss)
    codes = faiss.downcast_index(codes.storage) if backend == "hnsw" else codes
    assert idx.entities.vecs.data_ptr() == faiss.rev_swig_ptr(codes.codes.data(), 1).ctypes.data
    assert idx.entities.vecs.dtype == dtype and torch.equal(idx.entities.vecs, e.to(dtype))
    reference = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", storage=storage, chunk_rows=64))
    got, want = idx.gumbel_topk(q, 9, gold, 3, keys), reference.gumbel_topk(q, 9, gold, 3, keys)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.keys, want.keys)
    rows = torch.tensor([[1, 2, 250]] * 4)
    assert torch.equal(idx.score_rows(q, rows), reference.score_rows(q, rows))
    view = idx.entities.vecs
    del idx, codes
    gc.collect()
    torch.randn(300, 16)  # reuse freed memory, if the view's storage had been freed
    assert torch.equal(view, e.to(dtype))  # the view keeps the faiss index alive


def test_ivf_keeps_its_own_copy_of_the_vectors():
    """IVF lists reorder the rows, so the exact paths keep a row-ordered torch copy."""
    e, _ = clustered(300, 16, 6, 0.4, seed=21)
    idx = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="ivf", nlist=8))
    assert idx.entities.vecs.data_ptr() == e.data_ptr() and torch.equal(idx.entities.vecs, e)


def test_bf16_scores_are_fp32_sums_of_exact_bf16_products():
    # score_dtype bf16: entity rows stored bf16, queries rounded to bf16, products summed in fp32.
    e, q = torch.randn(300, 64, generator=gen(30)) * 2, torch.randn(7, 64, generator=gen(31))
    fp32 = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", chunk_rows=64))
    bf16 = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", chunk_rows=64, score_dtype="bf16"))
    rows = torch.arange(300).expand(7, 300)
    s32, s16 = fp32.score_rows(q, rows), bf16.score_rows(q, rows)
    magnitude = q.abs() @ e.abs().T  # sum_i |q_i e_i|
    # reference: the exact (float64) dot products of the bf16-rounded vectors; fp32 summation
    # of 64 exact products errs by at most ~64 * 2^-24 of the magnitude
    exact = q.bfloat16().double() @ e.bfloat16().double().T
    assert float(((s16.double() - exact).abs() / magnitude).max()) < 64 * 2 ** -24
    # against fp32 scoring: two bf16 roundings (unit roundoff 2^-8) per product, the stated tolerance
    rel = (s16 - s32).abs() / magnitude
    assert float(rel.max()) <= 2 ** -7 * 1.01 and float(rel.max()) > 2 ** -12  # bf16 really was used
    # the sampler scores the same rounded values as score_rows (what mixed-p log-probabilities
    # use; a GEMM and per-row dots may differ in the fp32 summation order only)
    got = bf16.gumbel_topk(q, 5, None, 1, torch.arange(7))
    torch.testing.assert_close(got.scores, s16.gather(1, got.ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(got.scores, exact.float().gather(1, got.ids), rtol=0, atol=1e-5)
    # memory: half the bytes of the fp32 shard
    assert bf16.entities.vecs.dtype == torch.bfloat16
    assert bf16.entities.vecs.untyped_storage().nbytes() * 2 == fp32.entities.vecs.untyped_storage().nbytes()


def test_score_dtype_is_validated():
    from dist_nce.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="score_dtype"):
        from_dict(IndexConfig, {"score_dtype": "fp16"}, "configs/x.yaml")
    with pytest.raises(ValueError, match="score_dtype bf16 needs backend 'torch'"):
        IndexConfig(backend="flat", score_dtype="bf16").validate()
    with pytest.raises(ValueError, match="leave index.storage and index.compute at fp32"):
        IndexConfig(backend="torch", score_dtype="bf16", compute="bf16").validate()
    assert from_dict(IndexConfig, {"backend": "torch", "score_dtype": "bf16"}, "x.yaml").storage_dtype() == torch.bfloat16
