"""The block sampler (dist_nce.sampling.block_gumbel): eq. 23, its law against the dense sampler's,
sharded == flat bit for bit, and edge cases (gold-only blocks, short shards, tiny KBs, bf16/fp16)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from dist_nce.core.config import ConfigError, from_dict
from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import exact_search
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling import negatives as ng
from dist_nce.sampling import block_gumbel as bg
from dist_nce.sampling.topk import merge_results

DUAL = ScoreSpec.preset("dual")
INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi2_pvalue(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ----------------------------------------------------------------- eq. 23


def test_truncated_gumbel_is_eq23_and_keeps_the_maximum():
    g = gen(0)
    phi = torch.randn(50, 7, generator=g, dtype=torch.float64) * 3
    top = phi.amax(1) + torch.rand(50, generator=g, dtype=torch.float64) * 4 - 2  # T above or below Z
    got = bg.truncated_gumbel(phi, top)
    z = phi.amax(1, keepdim=True)
    naive = -torch.log(torch.exp(-top[:, None]) - torch.exp(-z) + torch.exp(-phi))  # Kool et al. eq. 23
    torch.testing.assert_close(got, naive, rtol=1e-12, atol=1e-12)
    assert torch.equal(got.amax(1), top)  # the argmax row gets T exactly
    assert torch.equal(got.argmax(1), phi.argmax(1))  # order inside the block is kept
    # stable where the naive form overflows: keys ~ 800 apart
    far = torch.tensor([[0.0, -800.0, -1.0]], dtype=torch.float64)
    out = bg.truncated_gumbel(far, torch.tensor([750.0], dtype=torch.float64))
    assert torch.isfinite(out).all() and float(out[0, 0]) == 750.0 and float(out[0, 1]) == -800.0


def test_truncated_gumbel_masks_and_dead_blocks():
    phi = torch.tensor([[1.0, INF, 0.5], [INF, INF, INF]], dtype=torch.float64)
    out = bg.truncated_gumbel(phi, torch.tensor([2.0, INF], dtype=torch.float64))
    assert float(out[0, 0]) == 2.0 and out[0, 1] == INF and math.isfinite(float(out[0, 2]))
    assert (out[1] == INF).all() and not torch.isnan(out).any()


def test_truncated_keys_given_a_gumbel_maximum_are_iid_gumbels():
    # T ~ Gumbel(logsumexp s) and eq. 23 on s + G: each key must be Gumbel(s_i) (mean s_i + euler,
    # variance pi^2/6) and the keys uncorrelated.
    n, s = 400_000, torch.tensor([1.0, -0.5, 0.3, 2.0], dtype=torch.float64)
    g = gen(1)

    def gum(*shape):
        return -torch.log(-torch.log(torch.rand(*shape, generator=g, dtype=torch.float64)))

    top = torch.logsumexp(s, 0) + gum(n)
    keys = bg.truncated_gumbel(s + gum(n, 4), top)
    euler = 0.5772156649015329
    sd = math.pi / math.sqrt(6)
    assert float(((keys.mean(0) - s - euler).abs() / (sd / math.sqrt(n))).max()) < 5
    assert float((keys.var(0) / sd ** 2 - 1).abs().max()) < 0.02
    corr = torch.corrcoef(keys.T) - torch.eye(4, dtype=torch.float64)
    assert float(corr.abs().max()) < 5 / math.sqrt(n)


@pytest.mark.parametrize("k", [1, 4, 9, 12])
def test_truncated_keys_pick_exactly_what_all_keys_pick(k):
    # rows_from_blocks computes eq. 23 only for rows that can reach the k-th best block maximum
    from dist_nce.sampling.topk import result_from_keys

    for seed in range(10):
        g = gen(100 + seed)
        batch, c, b = 7, 12, 16
        s = torch.randn(batch, c, b, generator=g, dtype=torch.float64) * (1 + seed % 3)
        s[torch.rand(batch, c, b, generator=g) < 0.2] = INF  # gold, dead, rows of other shards
        s[0, 3] = INF  # a dead block
        phi = s - torch.log(-torch.log(torch.rand(batch, c, b, generator=g, dtype=torch.float64)))
        top = torch.logsumexp(s, -1) - torch.log(-torch.log(torch.rand(batch, c, generator=g, dtype=torch.float64)))
        top[1, :4] = top[1, 4]  # exact ties among block maxima, also across the k-th place
        top[0, 3] = INF
        ids = torch.arange(c * b).expand(batch, -1)
        want = result_from_keys(bg.truncated_gumbel(phi, top).reshape(batch, -1), s.float().reshape(batch, -1),
                                ids, k)
        got = result_from_keys(bg.truncated_keys(phi, top, k).reshape(batch, -1), s.float().reshape(batch, -1),
                               ids, k)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.keys, want.keys)


def test_block_noise_is_its_own_stream():
    q, c = torch.arange(3), torch.tensor([0, 4, 8])
    blk = bg.block_noise(5, q, c)
    assert torch.equal(blk, ng.gumbel_noise(5, q, c | (1 << 62)))
    assert not torch.isclose(blk, ng.gumbel_noise(5, q, c)).any()


# ----------------------------------------------------------------- the law


def _ordered_pairs(ids: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(ids[:, 0] * n + ids[:, 1], minlength=n * n).double()


def test_block_and_dense_agree_on_ordered_pairs():
    # 12 rows (row 5 gold), K-1 = 2, blocks of 3: two-sample chi-square on the 110 ordered
    # pairs, and each sampler's total variation from the exact successive-sampling law.
    n, draws = 12, 150_000
    s = torch.tensor([0.5, 1.0, -0.3, 2.0, 0.1, 3.0, -1.0, 0.7, 1.5, 0.0, -0.5, 1.2])
    scores, gold = s.expand(draws, n), torch.full((draws,), 5)
    dense = ng.sample_hard(scores, 2, gold, 3, torch.arange(draws)).ids
    block = ng.sample_hard(scores, 2, gold, 3, torch.arange(draws), sampler="block", block_rows=3).ids
    a, b = _ordered_pairs(dense, n), _ordered_pairs(block, n)
    cells = (a + b) > 0
    a, b = a[cells], b[cells]
    stat = float(((a - b) ** 2 / (a + b)).sum())  # equal sample sizes
    assert chi2_pvalue(stat, int(cells.sum()) - 1) > 1e-4
    p = torch.softmax(s.double().masked_fill(torch.arange(n) == 5, INF), 0)
    law = torch.zeros(n * n, dtype=torch.float64)
    for i, j in itertools.permutations(range(n), 2):
        if 5 not in (i, j):
            law[i * n + j] = p[i] * p[j] / (1 - p[i])
    for counts in (_ordered_pairs(dense, n), _ordered_pairs(block, n)):
        assert 0.5 * float((counts / draws - law).abs().sum()) < 0.012
    # a negative control: dense on scores at temperature 1.1 is far in TV
    tempered = ng.sample_hard(scores / 1.1, 2, gold, 3, torch.arange(draws)).ids
    assert 0.5 * float((_ordered_pairs(tempered, n) / draws - law).abs().sum()) > 0.03


def test_block_sampler_draws_noise_for_kept_blocks_only(monkeypatch):
    drawn = []
    real = ng.gumbel_noise

    def counting(seed, query_keys, rows):
        drawn.append(rows.numel() if rows.dim() == 2 else rows.numel() * query_keys.numel())
        return real(seed, query_keys, rows)

    monkeypatch.setattr(bg, "gumbel_noise", counting)  # the noise the block sampler draws
    batch, n, k, b = 4, 1000, 5, 10
    scores = torch.randn(batch, n, generator=gen(2))
    bg.gumbel_topk_block(scores, k, torch.zeros(batch, dtype=torch.int64), 1, torch.arange(batch), b)
    assert sum(drawn) == batch * (n // b + k * b)  # N/b block maxima + (K-1) x b rows per query


def test_block_log_mass_is_the_float64_logsumexp_to_float32_rounding():
    blocks = torch.randn(3, 40, 128, generator=gen(20)) * 8
    blocks[0, 1] = INF  # a dead block
    blocks[1, 2, :100] = INF  # a partly masked one
    blocks[2, 3] += 60  # far from 0: the max shift matters
    got, want = bg.block_log_mass(blocks), torch.logsumexp(blocks.double(), dim=-1)
    assert got.dtype == torch.float64 and got[0, 1] == INF
    live = want > INF
    assert float((got[live] - want[live]).abs().max()) < 1e-6


@pytest.mark.parametrize("k,chunk", [(5, 3), (5, 1), (40, 7), (1, 4)])
def test_block_stream_keeps_what_the_copying_reference_keeps(k, chunk):
    # BlockStream copies only blocks reaching the running k-th T; keep_best_blocks copies every
    # kept block at every chunk (the simple reference): same blocks, same bits.
    batch, nb, b = 6, 37, 4
    g = gen(21 + k)
    blocks = torch.randn(batch, nb, b, generator=g) * 3
    blocks[0, 5:9] = INF  # dead blocks
    blocks[1] = INF  # a query with nothing eligible: T = -inf ties everywhere
    counters = torch.arange(nb) * b
    keys = torch.arange(batch) + 50
    stream, ref = bg.BlockStream(k, 3, keys, b), None
    for a in range(0, nb, chunk):
        part, mass = blocks[:, a:a + chunk], bg.block_log_mass(blocks[:, a:a + chunk])
        stream.add(part, mass, counters[a:a + chunk])
        top = bg.block_maxima(mass, counters[a:a + chunk], 3, keys)
        ref = bg.keep_best_blocks(ref, bg.BlockSet(top, counters[a:a + chunk].expand(batch, -1), part), k)
    got = stream.finish()
    for x, y in zip(got, ref):
        assert torch.equal(x, y)
    torch.testing.assert_close(stream.log_z, torch.logsumexp(bg.block_log_mass(blocks), 1), rtol=1e-12, atol=0)
    assert sum(s.shape[0] for s in stream._scores) < batch * nb or k * chunk >= nb  # it did skip blocks


# ----------------------------------------------------------------- sharded == flat


def _shards(spec, ents: Reps, cfg: IndexConfig, layout) -> list[ShardIndex]:
    return [ShardIndex(spec, Reps(ents.vecs[a:b], None if ents.mask is None else ents.mask[a:b]), a, cfg)
            for a, b in layout]


@pytest.mark.parametrize("dtypes", [{"storage": "fp32", "compute": "fp32"}, {"storage": "bf16", "compute": "bf16"},
                                    {"storage": "fp16", "compute": "fp32"}, {"storage": "bf16", "compute": "fp32"},
                                    {"score_dtype": "bf16"}, {"score_dtype": "bf16", "kernel": "torch"}],
                         ids=lambda d: "-".join(d.values()))
def test_sharded_block_equals_flat_for_stored_dtypes(dtypes):
    e = torch.randn(203, 16, generator=gen(4))
    q = torch.randn(6, 16, generator=gen(5))
    gold, keys = torch.tensor([0, 202, 37, -1, 100, 150]), torch.arange(6) * 3
    cfg = IndexConfig(backend="torch", chunk_rows=32, sampler="block", block_rows=8, **dtypes)
    flat = ShardIndex(DUAL, Reps(e), 0, cfg).gumbel_topk(q, 12, gold, 9, keys)
    # starts on the 8-row grid, not on the 32-row score grid; the gold in different shards
    for layout in ([(0, 40), (40, 48), (48, 136), (136, 203)], [(0, 200), (200, 203)], [(0, 104), (104, 203)]):
        merged = merge_results([s.gumbel_topk(q, 12, gold, 9, keys) for s in _shards(DUAL, Reps(e), cfg, layout)], 12)
        assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
        assert torch.equal(merged.scores, flat.scores)
        torch.testing.assert_close(merged.log_z, flat.log_z, rtol=1e-12, atol=1e-12)
    assert (flat.ids >= 0).all() and not (flat.ids == gold[:, None]).any()


def test_unaligned_shards_are_exact_but_drawn_per_piece():
    # A shard starting inside a block samples its piece as a block of its own: still the
    # exact law (tests/index/test_search.py checks it statistically), not the flat draw.
    e = torch.randn(64, 8, generator=gen(6))
    q = torch.randn(50, 8, generator=gen(7))
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8)
    flat = ShardIndex(DUAL, Reps(e), 0, cfg).gumbel_topk(q, 6, None, 1, torch.arange(50))
    merged = merge_results([s.gumbel_topk(q, 6, None, 1, torch.arange(50))
                            for s in _shards(DUAL, Reps(e), cfg, [(0, 29), (29, 64)])], 6)
    assert not torch.equal(merged.ids, flat.ids)
    torch.testing.assert_close(merged.log_z, flat.log_z)


def test_short_shards_gold_only_blocks_and_tiny_kbs():
    cfg = IndexConfig(backend="torch", chunk_rows=8, sampler="block", block_rows=4)
    e = torch.randn(9, 4, generator=gen(8))  # blocks {0..3} {4..7} {8}
    q = torch.randn(3, 4, generator=gen(9))
    gold = torch.tensor([[8, -1], [4, 5], [0, 8]])  # the last block is gold only for rows 0 and 2
    keys = torch.tensor([5, 6, 7])
    flat = ShardIndex(DUAL, Reps(e), 0, cfg).gumbel_topk(q, 10, gold, 2, keys)  # K-1 > eligible rows
    assert ((flat.ids >= 0).sum(1) == torch.tensor([8, 7, 7])).all()
    assert (flat.keys[flat.ids < 0] == INF).all() and (flat.scores[flat.ids < 0] == INF).all()
    for layout in ([(0, 4), (4, 8), (8, 9)], [(0, 8), (8, 9)]):
        parts = [s.gumbel_topk(q, 10, gold, 2, keys) for s in _shards(DUAL, Reps(e), cfg, layout)]
        merged = merge_results(parts, 10)
        assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    last = parts[-1]  # the shard [8, 9): gold only for queries 0 and 2
    assert (last.ids[[0, 2]] == -1).all() and last.log_z[0] == INF and last.log_z[2] == INF
    assert last.ids[1].tolist() == [8] + [-1] * 9
    # tiny KBs: one row (the gold: nothing to draw), two rows, k > N
    for n in (1, 2, 3):
        ents, one = torch.randn(n, 4, generator=gen(n)), torch.zeros(1, dtype=torch.int64)
        res = ShardIndex(DUAL, Reps(ents), 0, cfg).gumbel_topk(q[:1], 5, one, 0, one)
        assert torch.equal(res.keys[0, :n - 1], res.keys[0, :n - 1].sort(descending=True).values)
        assert sorted(res.ids[0, :n - 1].tolist()) == list(range(1, n)) and (res.ids[0, n - 1:] == -1).all()
    # an empty shard through exact_search directly
    empty = exact_search(DUAL, Reps(q), Reps(torch.zeros(0, 4)), 12, 3, None, 8, seed=1, query_keys=keys,
                         sampler="block", block_rows=4)
    assert (empty.ids == -1).all() and (empty.log_z == INF).all()


def test_block_matches_the_flat_reference_function():
    e = torch.randn(100, 8, generator=gen(10))
    q = torch.randn(4, 8, generator=gen(11))
    gold, keys = torch.tensor([1, 50, -1, 99]), torch.arange(4)
    # the torch path (the native kernels sum each score in their own order: tests/sampling/test_block_native.py)
    res = ShardIndex(DUAL, Reps(e), 0, IndexConfig(backend="torch", chunk_rows=20, sampler="block", block_rows=5,
                                                  kernel="torch")).gumbel_topk(q, 7, gold, 4, keys)
    ref = bg.gumbel_topk_block((q @ e.T).float(), 7, gold, 4, keys, block_rows=5)
    assert torch.equal(res.ids, ref.ids)
    torch.testing.assert_close(res.keys, ref.keys)


def test_sampler_config_is_validated():
    with pytest.raises(ValueError, match=r"block_rows \(48\) must divide index.chunk_rows \(8192\)"):
        IndexConfig(sampler="block", block_rows=48, chunk_rows=8192).validate()
    IndexConfig(sampler="dense", block_rows=48).validate()  # block_rows only matters for the block sampler
    cfg = from_dict(IndexConfig, {"sampler": "block", "block_rows": 64}, "configs/x.yaml")
    assert cfg.sampler == "block" and cfg.block_rows == 64
    with pytest.raises(ConfigError, match="sampler"):
        from_dict(IndexConfig, {"sampler": "blocks"}, "configs/x.yaml")
    with pytest.raises(ConfigError, match="block_rows"):
        from_dict(IndexConfig, {"block_rows": 0}, "configs/x.yaml")
    assert from_dict(IndexConfig, {"kernel": "torch"}, "configs/x.yaml").kernel == "torch"
    with pytest.raises(ConfigError, match="kernel"):
        from_dict(IndexConfig, {"kernel": "cuda"}, "configs/x.yaml")
    with pytest.raises(ValueError, match="sampler must be 'dense' or 'block'"):
        exact_search(DUAL, Reps(torch.randn(2, 4)), Reps(torch.randn(5, 4)), 0, 2, None, 8, seed=0,
                     query_keys=torch.arange(2), sampler="exact")



def test_default_sampler_is_block_where_it_applies_else_dense():
    # issue 35 item 5: the dense sampler (one Gumbel per row) took 17-19x a GEMM + top-k on an H200;
    # the block sampler draws the same law, so the default "auto" takes it wherever it can run
    assert IndexConfig().sampler == "auto" and IndexConfig().resolved_sampler() == "block"  # flat: exact mode
    for score_dtype in ("fp32", "bf16"):
        cfg = IndexConfig(backend="torch", score_dtype=score_dtype)
        cfg.validate()
        assert cfg.resolved_sampler() == "block" and cfg.row_grid() == cfg.block_rows == 128
    assert IndexConfig(backend="torch", chunk_rows=4096, block_rows=64).resolved_sampler() == "block"
    # where block cannot apply, auto is dense (and shards keep a row grid of 1) rather than an error
    for cfg in (IndexConfig(backend="ivf"), IndexConfig(backend="hnsw"),  # candidates mode: no exact sampler
                IndexConfig(backend="torch", gumbel="candidates"),
                IndexConfig(backend="torch", chunk_rows=100),  # 128-row blocks cannot tile 100-row chunks
                IndexConfig(backend="torch", chunk_rows=32, block_rows=48)):
        cfg.validate()
        assert cfg.resolved_sampler() == "dense" and cfg.row_grid() == 1 and cfg.row_grid(10_000, 4) == 1
    with pytest.raises(ValueError, match="must divide"):  # an explicit block still says why not
        IndexConfig(backend="torch", chunk_rows=100, sampler="block").validate()
    # explicit choices are kept
    assert IndexConfig(backend="torch", sampler="dense").resolved_sampler() == "dense"
    assert IndexConfig(backend="torch", sampler="dense").row_grid(10_000, 4) == 1
    assert IndexConfig(backend="ivf", sampler="block").resolved_sampler() == "block"
    assert from_dict(IndexConfig, {}, "configs/x.yaml").resolved_sampler() == "block"
    assert from_dict(IndexConfig, {"sampler": "auto"}, "configs/x.yaml").sampler == "auto"
    # shard boundaries: on the block grid when the KB splits on it; a tiny KB (test configs: 120
    # entities, 2 shards) is split evenly under auto instead of being refused
    auto, block = IndexConfig(backend="torch"), IndexConfig(backend="torch", sampler="block")
    assert auto.row_grid(1000, 3) == block.row_grid(1000, 3) == 128
    assert auto.row_grid(120, 2) == 1 and block.row_grid(120, 2) == 128
    assert auto.row_grid(129, 2) == 128 and auto.row_grid(128, 2) == 1  # the cut at 64 rounds up to 128: empty


@pytest.mark.parametrize("score_dtype", ["fp32", "bf16"])
def test_default_config_search_draws_the_dense_law(score_dtype):
    # A ShardIndex with the default sampler over 12 rows (row 5 gold) in blocks of 3: its draws are the
    # explicit block sampler's bit for bit, and follow the law of the explicit dense reference (two-sample
    # chi-square on the ordered pairs) and the exact successive-sampling law (total variation).
    n, draws = 12, 100_000
    s = torch.tensor([0.5, 1.0, -0.3, 2.0, 0.1, 3.0, -1.0, 0.7, 1.5, 0.0, -0.5, 1.2])
    ents = Reps(torch.diag(s))  # row i scores s[i] against the all-ones query
    q, gold, keys = torch.ones(draws, n), torch.full((draws,), 5), torch.arange(draws)

    def draw(**kw):
        cfg = IndexConfig(backend="torch", score_dtype=score_dtype, block_rows=3, chunk_rows=12, kernel="torch",
                          **kw)
        return ShardIndex(DUAL, ents, 0, cfg).gumbel_topk(q, 2, gold, 3, keys).ids

    default, block, dense = draw(), draw(sampler="block"), draw(sampler="dense")
    assert torch.equal(default, block) and not torch.equal(default, dense)
    a, b = _ordered_pairs(default, n), _ordered_pairs(dense, n)
    cells = (a + b) > 0
    a, b = a[cells], b[cells]
    assert chi2_pvalue(float(((a - b) ** 2 / (a + b)).sum()), int(cells.sum()) - 1) > 1e-4
    law_scores = s.bfloat16().float() if score_dtype == "bf16" else s  # the scores the index computes
    p = torch.softmax(law_scores.double().masked_fill(torch.arange(n) == 5, INF), 0)
    law = torch.zeros(n * n, dtype=torch.float64)
    for i, j in itertools.permutations(range(n), 2):
        if 5 not in (i, j):
            law[i * n + j] = p[i] * p[j] / (1 - p[i])
    for ids in (default, dense):
        assert 0.5 * float((_ordered_pairs(ids, n) / draws - law).abs().sum()) < 0.015

@pytest.mark.parametrize("k", [1, 4, 12, 30])
def test_rows_from_blocks_ranks_only_the_near_rows_and_answers_as_all_keys_do(k):
    # the CPU's step 3 ranks the ~k rows that can reach the top k; the GPU's ranks every row
    for seed in range(6):
        g = gen(200 + seed)
        batch, c, b = 9, 12, 16
        scores = (torch.randn(batch, c, b, generator=g) * (1 + seed % 3)).float()
        scores[torch.rand(batch, c, b, generator=g) < 0.2] = INF
        scores[0, 3] = INF  # a dead block
        if seed % 2:
            scores = scores.round()  # exact ties among scores
        top = torch.logsumexp(scores.double(), -1) - torch.log(-torch.log(torch.rand(batch, c, generator=g,
                                                                                   dtype=torch.float64)))
        top[1, :4] = top[1, 4]  # exact ties among block maxima
        top[0, 3] = INF
        counters = (torch.randperm(40, generator=g)[:c].sort().values * b).expand(batch, -1).clone()
        counters[2, -1] = -1  # an empty slot
        kept = bg.BlockSet(top, counters, scores)
        keys, log_z = torch.arange(batch) * 3, torch.zeros(batch, dtype=torch.float64)
        near = bg.rows_from_blocks(kept, k, 7, keys, log_z)
        every = bg.rows_from_blocks(kept, k, 7, keys, log_z, filter_rows=False)
        for got, want in zip(near[:3], every[:3]):  # ids, scores, keys
            assert torch.equal(got, want)
