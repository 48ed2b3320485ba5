"""KB deltas in the pure search layer: LiveIndex pieces and removed rows, placement, live sampling.

Every answer over pieces spread on several shards, with removed rows, is compared with one
flat search over the same row space (bit for bit), and the samplers with the exact law over
the SURVIVING rows (the statistical helpers of tests/sampling/test_negatives.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_nce.actors.placement import place_rows, water_fill
from dist_nce.bias.gradbias import lse_grad_all
from dist_nce.index.config import IndexConfig
from dist_nce.index.live import LiveIndex
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling.live_rows import LiveRows, mixed_from_pool_live, random_pool_live, sample_random_live
from dist_nce.sampling.negatives import sample_random
from dist_nce.sampling.topk import merge_results
from tests.sampling.test_negatives import chi2_pvalue, inclusion_max_z, successive_sampling  # noqa: E402  (tests/ on sys.path)

DUAL = ScoreSpec.preset("dual")
BASE, COUNT, D = 203, 277, 8  # version 0 had 203 rows; deltas appended 74


def shards_after_deltas(grid: int) -> list[list[tuple[int, int]]]:
    """Two shards: even base split on the grid, then two deltas placed by place_rows."""
    base = [(0, 104 if grid > 1 else 101), (104 if grid > 1 else 101, BASE)]
    pieces = [[r] for r in base]
    for first, count in ((BASE, 240), (240, COUNT)):
        loads = [sum(b - a for a, b in rs) for rs in pieces]
        tail = next(i for i, rs in enumerate(pieces) for a, b in rs if a < first <= b)
        for rs, new in zip(pieces, place_rows(first, count, loads, grid, tail)):
            rs += new
    return pieces


def live_index(vecs: torch.Tensor, ranges, dead, config, version=3) -> LiveIndex:
    pieces = [ShardIndex(DUAL, Reps(vecs[a:b]), a, config, version) for a, b in ranges]
    return LiveIndex(pieces, dead, version, kb_version=2)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    vecs = torch.randn(COUNT, D, generator=g)
    dead = torch.tensor(sorted({5, 6, 7, 100, 101, 150, 203, 204, 230, 276}))
    q = torch.randn(5, D, generator=g)
    gold = torch.tensor([0, 205, 101, -1, 250])  # 101: a removed gold
    return vecs, dead, q, gold


# --------------------------------------------------------------------------- placement


def test_water_fill_levels_loads():
    assert water_fill([10, 4, 7], 5) == [0, 4, 1]
    assert water_fill([10, 4, 7], 30) == [7, 13, 10]
    assert sum(water_fill([3, 3, 3], 7)) == 7


@pytest.mark.parametrize("grid", [1, 8])
def test_placement_covers_new_rows_once_in_whole_blocks(grid):
    pieces = shards_after_deltas(grid)
    rows = sorted(r for rs in pieces for a, b in rs for r in range(a, b))
    assert rows == list(range(COUNT))
    for block in range(0, COUNT, grid):  # every grid block lies in one shard
        owners = {i for i, rs in enumerate(pieces) for a, b in rs if a < block + grid and block < b}
        assert len(owners) == 1, (block, pieces)
    loads = [sum(b - a for a, b in rs) for rs in pieces]
    assert max(loads) - min(loads) <= grid + 2


# --------------------------------------------------------------------------- sharded == flat


CONFIGS = [pytest.param(IndexConfig(backend="torch", chunk_rows=32), 1, id="torch-dense"),
           pytest.param(IndexConfig(backend="torch", chunk_rows=32, sampler="block", block_rows=8), 8,
                        id="torch-block"),
           pytest.param(IndexConfig(backend="flat", chunk_rows=32), 1, id="faiss-flat")]


@pytest.mark.parametrize("config, grid", CONFIGS)
def test_pieces_with_removed_rows_equal_one_flat_search(data, config, grid):
    vecs, dead, q, gold = data
    shards = [live_index(vecs, rs, dead, config) for rs in shards_after_deltas(grid)]
    flat = live_index(vecs, [(0, COUNT)], dead, config)
    keys = torch.arange(40, 45)
    for k in (1, 9):
        got = merge_results([s.topk(q, k, gold) for s in shards], k)
        want = flat.topk(q, k, gold)
        assert torch.equal(got.ids, want.ids) and got.version == 3
        if config.backend == "torch":
            assert torch.equal(got.scores, want.scores)
        else:  # faiss's BLAS path depends on the matrix shapes: ulps apart
            torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)
        sample = merge_results([s.gumbel_topk(q, k, gold, 7, keys) for s in shards], k)
        ref = flat.gumbel_topk(q, k, gold, 7, keys)
        assert torch.equal(sample.ids, ref.ids) and torch.equal(sample.keys, ref.keys), "bit for bit"
        for res in (got, sample):
            assert not torch.isin(res.ids, dead).any() and not (res.ids == gold[:, None]).any()
    # log_z: the gold-excluded logsumexp over LIVE rows only
    live = torch.ones(COUNT, dtype=torch.bool)
    live[dead] = False
    s = q @ vecs.T
    s[:, ~live] = -math.inf
    s[torch.arange(5)[gold >= 0], gold[gold >= 0]] = -math.inf
    torch.testing.assert_close(sample.log_z, torch.logsumexp(s.double(), 1), rtol=0, atol=1e-5)


def test_lse_grad_leaves_removed_rows_out(data):
    vecs, dead, q, _ = data
    config = IndexConfig(backend="torch", chunk_rows=32)
    parts = [live_index(vecs, rs, dead, config).lse_grad(q) for rs in shards_after_deltas(1)]
    from dist_nce.bias.gradbias import merge

    got = merge(parts)
    live = torch.ones(COUNT, dtype=torch.bool)
    live[dead] = False
    want = lse_grad_all(DUAL, Reps(q), Reps(vecs[live]), 64)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-6, atol=1e-6)  # float32 scores, other chunking
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    # a chunk whose rows are all removed adds nothing (no NaN)
    only = lse_grad_all(DUAL, Reps(q), Reps(vecs[:8]), 4, dead=torch.arange(4))
    torch.testing.assert_close(only.lse, torch.logsumexp((q @ vecs[4:8].T).double(), 1))


def test_single_piece_without_removals_is_the_plain_shard_index(data):
    vecs, _, q, gold = data
    config = IndexConfig(backend="torch", chunk_rows=32)
    plain = ShardIndex(DUAL, Reps(vecs[:100]), 0, config, 3)
    live = LiveIndex([plain], None, 3)
    keys = torch.arange(5)
    a, b = live.gumbel_topk(q, 6, gold.clamp(max=99), 1, keys), plain.gumbel_topk(q, 6, gold.clamp(max=99), 1, keys)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.keys, b.keys) and torch.equal(a.log_z, b.log_z)


# --------------------------------------------------------------------------- the law over the surviving rows


# 14 rows, 4 removed: the 10 survivors carry the scores of tests/sampling/test_negatives.py, survivor 0 is the gold.
SURVIVOR_SCORES = [2.5, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 0.8, -1.0, 1.2]
DEAD_ROWS = [2, 5, 6, 11]
DRAWS, K = 100_000, 3


@pytest.mark.parametrize("config, grid", [CONFIGS[0], pytest.param(
    IndexConfig(backend="torch", chunk_rows=4, sampler="block", block_rows=2), 2, id="torch-block")])
def test_hard_sampler_over_survivors_matches_the_exact_law(config, grid):
    survivors = [r for r in range(14) if r not in DEAD_ROWS]
    col = torch.full((14, 1), 9.0)  # removed rows score highest: any leak would show at once
    col[survivors, 0] = torch.tensor(SURVIVOR_SCORES)
    dead = torch.tensor(DEAD_ROWS)
    shards = [live_index(col, rs, dead, config) for rs in ([(0, 4), (10, 14)], [(4, 10)])]
    q = torch.ones(DRAWS, 1)
    gold = torch.full((DRAWS,), survivors[0])
    got = merge_results([s.gumbel_topk(q, K, gold, 5, torch.arange(DRAWS)) for s in shards], K)
    assert not torch.isin(got.ids, dead).any()
    label = {r: i - 1 for i, r in enumerate(survivors)}  # survivors 1..9 -> labels 0..8
    samples = got.ids.apply_(lambda r: label[r])
    law = successive_sampling(torch.softmax(torch.tensor(SURVIVOR_SCORES[1:], dtype=torch.float64), 0).tolist(), K)
    pi = torch.zeros(9, dtype=torch.float64)
    for seq, prob in law.items():
        for i in seq:
            pi[i] += prob
    assert inclusion_max_z(samples, pi) < 5.0
    index = {seq: j for j, seq in enumerate(law)}
    counts = torch.bincount(torch.tensor([index[tuple(s)] for s in samples.tolist()]), minlength=len(law)).double()
    assert chi2_pvalue(counts, torch.tensor(list(law.values()), dtype=torch.float64) * DRAWS) > 1e-4


# --------------------------------------------------------------------------- random negatives over live rows


def test_live_rows_rank_and_row_are_inverse():
    live = LiveRows(10, torch.tensor([2, 3, 7]))
    assert live.rank(torch.arange(-1, 11)).tolist() == [-1, 0, 1, -1, -1, 2, 3, 4, -1, 5, 6, -1]
    assert live.row(torch.arange(7)).tolist() == [0, 1, 4, 5, 6, 8, 9]


def test_random_negatives_are_uniform_over_live_rows_minus_gold_and_hard():
    dead = torch.tensor([1, 4, 5, 9])
    live = LiveRows(12, dead)
    gold = torch.full((60_000,), 3)
    hard = torch.tensor([[0, 11]]).expand(60_000, 2)
    negs = sample_random_live(live, 2, gold, 3, exclude=hard)
    allowed = [2, 6, 7, 8, 10]
    counts = torch.bincount(negs.ids.flatten(), minlength=12).double()
    assert counts[[r for r in range(12) if r not in allowed]].sum() == 0
    expected = torch.full((5,), 2 * 60_000 / 5, dtype=torch.float64)
    assert chi2_pvalue(counts[allowed], expected) > 1e-4
    torch.testing.assert_close(negs.log_q, torch.full_like(negs.log_q, -math.log(8 - 1 - 2)))
    # no removed rows: exactly the plain sampler
    full = LiveRows.full(12)
    assert torch.equal(sample_random_live(full, 3, gold[:50], 9).ids, sample_random(12, 3, gold[:50], 9).ids)


def test_mixed_negatives_use_live_n(data):
    vecs, dead, q, gold = data
    config = IndexConfig(backend="torch", chunk_rows=32)
    flat = live_index(vecs, [(0, COUNT)], dead, config)
    live = LiveRows(COUNT, dead)
    gold = gold.clamp(min=0)
    pool = random_pool_live(live, 9, gold, 4)
    assert not torch.isin(pool, dead).any()
    hard = flat.gumbel_topk(q, 5, gold, 3, torch.arange(5))
    negs = mixed_from_pool_live(hard, live, 9, 50, gold, pool, flat.score_rows(q, pool))
    assert not torch.isin(negs.ids, dead).any() and negs.hard.sum(1).tolist() == [5] * 5
    rand = ~negs.hard
    s = flat.score_rows(q, negs.ids).double()
    want = torch.logaddexp(s - hard.log_z[:, None] + math.log(5 / 9),
                           torch.full_like(s, math.log(4 / 9) - math.log(live.num_live - 1)))
    torch.testing.assert_close(negs.log_q[rand].double(), want[rand], rtol=0, atol=1e-5)


@pytest.mark.parametrize("config, grid", CONFIGS)
def test_an_index_carrying_removed_rows_excludes_them_by_default(data, config, grid):
    """In-process indexes over a changed store (retrieval.build_local_index, the linker's snapshot
    index) carry the store's tombstones: plain calls never return or sample a removed row."""
    vecs, dead, q, gold = data
    carrying = ShardIndex(DUAL, Reps(vecs), 0, config, 3, dead=dead)
    live = live_index(vecs, [(0, COUNT)], dead, config)
    keys = torch.arange(5)
    assert torch.equal(carrying.topk(q, 9, gold).ids, live.topk(q, 9, gold).ids)
    assert torch.equal(carrying.gumbel_topk(q, 9, gold, 2, keys).ids, live.gumbel_topk(q, 9, gold, 2, keys).ids)
    assert not torch.isin(carrying.topk(q, 30).ids, dead).any()
