"""The GPU path of the exact search (kernels/block_reduce.py, kernels/gumbel.py,
sampling/block_fused.py, index.exact._fused_search), run here through Triton's interpreter on
CPU tensors: the fused block keys and noise against torch, top-k against the dense reference (ties included), the sampler's law
(first draw, ordered pairs, inclusion, against the dense sampler), sharded == flat bit for bit
with pieces, dead rows and gold, the chunk grid and the kernel choice. The same tests run on a
GPU through benchmarks/gpu.py (``--law``)."""
from __future__ import annotations

import pytest
import torch

from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import Piece, auto_chunk_rows, exact_search, exact_search_pieces
from dist_nce.index.search import ShardIndex
from dist_nce.kernels import block_reduce as br
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling import negatives as ng
from dist_nce.kernels.gumbel import gumbel_noise_fused
from dist_nce.sampling import block_gumbel as bg
from dist_nce.sampling.noise import gumbel_noise
from dist_nce.sampling.block_gumbel import block_log_mass
from dist_nce.sampling.laws import successive_law, two_sample_p
from dist_nce.sampling.topk import mask_gold, merge_results

pytestmark = [pytest.mark.skipif(br.available("cpu") is not None, reason=f"{br.available('cpu')}"),
              # empty blocks take log 0 = -inf on purpose; the interpreter's numpy warns
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")]
DUAL = ScoreSpec.preset("dual")
INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_keys_are_the_masked_log_masses_and_maxima(dtype):
    s = (torch.randn(19, 256, generator=gen(1)) * 4).to(dtype)
    s[3, :64] = INF  # an empty block
    s[4, 70] = INF
    gold = torch.full((19, 2), -1)
    gold[0, 0], gold[1] = 1000 + 5, torch.tensor([1000 + 64, 1000 + 255])
    gold[2, 0] = 999  # outside the chunk: ignored
    ref = mask_gold(s.float(), gold, 1000).view(19, 4, 64)
    want = block_log_mass(ref)
    keys = torch.arange(19) * 3 + 1
    lm, t = torch.empty(19, 3, dtype=torch.float64), torch.empty(19, 3, dtype=torch.float64)
    br.block_keys(s, gold, 1000, 64, 1, 4, lm, t, seed=5, query_keys=keys, lo=1010)  # blocks 1-3 only
    assert torch.equal(lm == INF * 1, want[:, 1:] == INF)
    assert float((lm - want[:, 1:]).nan_to_num(0.0, 0.0, 0.0).abs().max()) < 1e-6
    counters = torch.tensor([1064, 1128, 1192])  # max(first row, lo)
    noise = bg.block_noise(5, keys, counters)
    assert float((t - lm - noise).nan_to_num(0.0, 0.0, 0.0).abs().max()) < 1e-12  # T = L + G, the same G
    assert torch.equal(t == INF * 1, lm == INF * 1)
    # no seed: (max desc, position asc) as one integer, -0.0 == 0.0
    s2 = torch.tensor([[1.0, -2.0, 1.0, 7.0, -0.0, 0.0, INF]]).repeat_interleave(4, dim=1)
    packed = torch.empty(1, 7, dtype=torch.int64)
    br.block_keys(s2, gold[:1, :0], 0, 4, 0, 7, torch.empty(1, 7, dtype=torch.float64), packed, pos0=100)
    assert torch.topk(packed, 7).indices[0].tolist() == [3, 0, 2, 4, 5, 1, 6]
    with pytest.raises(ValueError, match="power of two"):
        br.block_keys(s, gold, 0, 48, 0, 1, lm[:, :1], t[:, :1], seed=1, query_keys=keys)


def test_fused_noise_is_gumbel_noise():
    keys = torch.tensor([0, 1, 5, -7, 2 ** 40, 123456789])
    for seed in (0, 7, -3, 2 ** 62 + 5):
        for rows in (torch.arange(1000) * 37 - 5, torch.randint(0, 10 ** 9, (6, 300), generator=gen(seed % 97))):
            want = gumbel_noise(seed, keys, rows)
            got = gumbel_noise_fused(seed, keys, rows)
            # the same integers; the logs are numpy's here (libdevice's on a GPU): last-bit differences
            assert float((got - want).abs().max()) < 1e-14


def _data(n=3000, d=32, batch=45, seed=7, ties=False):
    e = (torch.randn(n, d, generator=gen(seed)) * 0.4).bfloat16()
    if ties:  # integer scores: many exact ties across blocks, shards and chunks
        e = torch.randint(-2, 3, (n, d), generator=gen(seed)).bfloat16()
    q = (e[torch.randint(0, n, (batch,), generator=gen(seed + 1))].float()
         + 0.2 * torch.randn(batch, d, generator=gen(seed + 2))).bfloat16().float()
    if ties:
        q = torch.randint(-1, 2, (batch, d), generator=gen(seed + 2)).float()
    gold = torch.randint(0, n, (batch, 2), generator=gen(seed + 3))
    gold[::3, 1] = -1
    return e, q, gold


@pytest.mark.parametrize("ties", [False, True])
def test_topk_equals_the_dense_reference(ties):
    e, q, gold = _data(n=1000, ties=ties)
    dead = torch.tensor([3, 64, 65, 999])
    kw = dict(chunk_rows=128, block_rows=16, dead=dead)
    want = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="torch", **kw)
    got = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="triton", **kw)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    assert torch.equal(got.keys, want.keys)
    torch.testing.assert_close(got.log_z, want.log_z, rtol=1e-6, atol=1e-6)
    parts = [exact_search(DUAL, Reps(q), Reps(e[a:b]), a, 20, gold, kernel="triton", **kw)
             for a, b in [(0, 200), (200, 203), (203, 1000)]]  # off the block grid: still exact
    merged = merge_results(parts, 20)
    assert torch.equal(merged.ids, want.ids) and torch.equal(merged.scores, want.scores)


def test_sharded_pieces_equal_flat_bit_for_bit():
    e, q, gold = _data()
    keys = torch.arange(q.shape[0]) * 5 + 1
    kw = dict(chunk_rows=64, seed=9, query_keys=keys, sampler="block", block_rows=16, kernel="triton")
    dead = torch.tensor([5, 700, 701, 2999])
    flat = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, dead=dead, **kw)
    parts = [exact_search_pieces(DUAL, Reps(q), [Piece(0, Reps(e[:992])), Piece(1008, Reps(e[1008:1024]))], 20,
                                 gold, dead=dead, **kw),
             exact_search_pieces(DUAL, Reps(q), [Piece(992, Reps(e[992:1008])), Piece(1024, Reps(e[1024:2048]))],
                                 20, gold, dead=dead, **kw),
             exact_search(DUAL, Reps(q), Reps(e[2048:]), 2048, 20, gold, dead=dead, **kw)]
    merged = merge_results(parts, 20)
    assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    assert torch.equal(merged.scores, flat.scores)
    torch.testing.assert_close(merged.log_z, flat.log_z, rtol=1e-12, atol=0)
    assert not torch.isin(flat.ids, dead).any() and not (flat.ids[:, :, None] == gold[:, None, :]).any()
    assert (flat.ids >= 0).all() and (flat.ids.sort(1).values.diff(dim=1) != 0).all()  # no duplicates
    # the torch block sampler: same counters and noise, L_B within float32 rounding
    ref = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, dead=dead, **{**kw, "kernel": "torch"})
    assert float((ref.ids == flat.ids).double().mean()) > 0.99
    assert float((ref.log_z - flat.log_z).abs().max()) < 1e-5


def test_short_kbs_empty_blocks_and_more_negatives_than_rows():
    e, q, gold = _data(n=40, batch=6)
    gold[:, 0] = torch.arange(6)
    kw = dict(chunk_rows=32, block_rows=8, kernel="triton", seed=1, query_keys=torch.arange(6), sampler="block")
    res = exact_search(DUAL, Reps(q), Reps(e[:5]), 30, 9, gold + 30, **kw)  # 5 rows, partial block
    assert res.ids.shape == (6, 9)
    for b in range(6):
        got = set(res.ids[b][res.ids[b] >= 0].tolist())
        assert got == set(range(30, 35)) - set((gold[b] + 30).tolist())
    assert (res.keys[res.ids < 0] == INF).all()
    top = exact_search(DUAL, Reps(q), Reps(e[:5]), 30, 9, gold + 30, **{**kw, "seed": None})
    assert torch.equal(top.ids.sort(1).values, res.ids.sort(1).values)


@pytest.mark.parametrize("layout", [[(0, 40)], [(0, 16), (16, 24), (24, 40)], [(0, 13), (13, 40)]],
                         ids=["flat", "sharded-on-grid", "unaligned"])
def test_sampler_draws_the_exact_law(layout):
    # 40 rows in blocks of 8, K-1 = 3: only 3 of the 5 blocks are kept per draw. Entity i scores
    # s_i against the all-ones query (one non-zero coordinate), row 0 is the gold.
    n, draws, k = 40, 30_000, 3
    s = torch.linspace(-1.5, 2.0, n)[torch.randperm(n, generator=gen(5))].bfloat16().float()
    q, gold = torch.ones(draws, n), torch.zeros(draws, dtype=torch.int64)
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, score_dtype="bf16",
                      kernel="triton")
    res = merge_results([ShardIndex(DUAL, Reps(torch.diag(s)[a:b]), a, cfg).gumbel_topk(q, k, gold, 17,
                                                                                       torch.arange(draws))
                         for a, b in layout], k)
    assert torch.equal(res.scores, s[res.ids]) and not (res.ids == 0).any()
    law = successive_law(res.ids, s, 1.15)
    assert law["first_draw_p"] > 1e-4 and law["ordered_pairs_p"] > 1e-4  # first draw; p_i p_j / (1 - p_i)
    assert law["wrong_temperature_p"] < 1e-6  # negative control: a wrong temperature is rejected
    assert law["inclusion_max_z"] < 5.0


def test_sampler_and_dense_sampler_agree_on_ordered_pairs():
    n, draws = 48, 40_000
    s = torch.randn(n, generator=gen(6)).mul(1.2).bfloat16().float()
    gold = torch.full((draws,), 7)
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, score_dtype="bf16",
                      kernel="triton")
    fused = ShardIndex(DUAL, Reps(torch.diag(s)), 0, cfg).gumbel_topk(torch.ones(draws, n), 2, gold, 3,
                                                                      torch.arange(draws)).ids
    dense = ng.sample_hard(s.expand(draws, n), 2, gold, 4, torch.arange(draws)).ids
    assert two_sample_p(fused[:, 0] * n + fused[:, 1], dense[:, 0] * n + dense[:, 1], n * n) > 1e-4


def test_chunk_grid_is_chosen_for_the_device():
    assert auto_chunk_rows("cpu", 128, 128) == 8192
    assert auto_chunk_rows("cuda", 128, 128) == 1 << 20  # 128 x 1M x 4 B = 512 MB
    assert auto_chunk_rows("cuda", 1024, 128) == 1 << 17
    assert auto_chunk_rows("cuda", 1, 128) == 1 << 22 and auto_chunk_rows("cuda", 1 << 20, 128) == 1 << 16
    assert auto_chunk_rows("cuda", 1024, 48) % 48 == 0
    # and the entity rows a chunk copies stay within 2 GB: a training batch of 8 BERT-base bf16 queries gets
    # 1M rows, not 4M (each GPU shard of a 1M-row KB copied and scored 4M padded rows every call); the KILT
    # benchmark's grids (1024 bf16 at B = 128 and 1024) are unchanged
    assert auto_chunk_rows("cuda", 8, 128) == 1 << 22
    assert auto_chunk_rows("cuda", 8, 128, vector_bytes=768 * 2) == 1 << 20
    assert auto_chunk_rows("cuda", 8, 128, vector_bytes=384 * 4) == 1 << 20
    assert [auto_chunk_rows("cuda", b, 128, vector_bytes=1024 * 2) for b in (128, 1024)] == [1 << 20, 1 << 17]
    assert auto_chunk_rows("cuda", 1, 128, vector_bytes=1 << 20) == 1 << 16  # never below 64k rows
    assert auto_chunk_rows("cpu", 8, 128, vector_bytes=768 * 2) == 8192
    # chunk_rows 0 (the default) searches on the auto grid: the same answer as naming it
    e, q, gold = _data(n=9000, batch=4)
    kw = dict(seed=3, query_keys=torch.arange(4), sampler="block", block_rows=128, kernel="torch")
    assert torch.equal(exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, chunk_rows=0, **kw).keys,
                       exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, chunk_rows=8192, **kw).keys)


def test_auto_grid_shrinks_with_the_vectors_per_row(monkeypatch):
    """A shard's partial block is padded to the grid and scored: with 8192 rows of 32 SOM columns a
    500-row world paid for 8192 rows. The auto grid keeps ~8192 vectors per block instead, and a
    sharded SOM sample on it is still the flat one, bit for bit."""
    assert auto_chunk_rows("cpu", 128, 128, vectors_per_row=32) == 256
    assert auto_chunk_rows("cpu", 128, 128, vectors_per_row=8) == 1024
    assert auto_chunk_rows("cpu", 128, 128, vectors_per_row=1000) == 128  # never below one block
    assert auto_chunk_rows("cuda", 128, 128, vectors_per_row=32) == (1 << 20) // 32
    som = ScoreSpec.preset("som")
    g = torch.Generator().manual_seed(5)
    n, t, d, b = 500, 32, 16, 6
    ents = Reps(torch.randn(n, t, d, generator=g), torch.arange(t)[None] < torch.randint(4, t + 1, (n, 1), generator=g))
    q = Reps(torch.randn(b, t, d, generator=g), torch.arange(t)[None] < torch.randint(2, t + 1, (b, 1), generator=g))
    gold = torch.randint(0, n, (b,), generator=g)
    from dist_nce.index import exact as ex
    scored = []
    real = ex.score_all
    monkeypatch.setattr(ex, "score_all", lambda spec, m, e, *a, **k: scored.append(e.vecs.shape[0]) or
                        real(spec, m, e, *a, **k))
    kw = dict(seed=3, query_keys=torch.arange(b), sampler="block", block_rows=128, kernel="torch")
    flat = exact_search(som, q, ents, 0, 5, gold, chunk_rows=0, **kw)
    assert sum(scored) == 512  # two 256-row blocks, not one of 8192
    pieces = [Piece(0, Reps(ents.vecs[:256], ents.mask[:256])), Piece(256, Reps(ents.vecs[256:], ents.mask[256:]))]
    parts = [exact_search_pieces(som, q, [p], 5, gold, 0, **kw) for p in pieces]
    merged = merge_results(parts, 5)
    assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    # a shard that owns no rows still answers (no piece to read the reps' shape from)
    assert exact_search_pieces(som, q, [], 5, gold, 0, kernel="torch").ids.shape == (b, 5)
    top = exact_search(som, q, ents, 0, 5, gold, chunk_rows=0, kernel="torch")
    assert torch.equal(top.ids, exact_search(som, q, ents, 0, 5, gold, chunk_rows=8192, kernel="torch").ids)


def test_kernel_choice():
    e, q, gold = _data(n=300, batch=4)
    poly = ScoreSpec.preset("poly", m=2)
    with pytest.raises(ValueError, match="index.kernel 'triton': the fused path scores single-vector"):
        exact_search(poly, Reps(q.view(4, 2, 16)), Reps(e), 0, 5, gold, chunk_rows=64, kernel="triton")
    with pytest.raises(ValueError, match="power of two"):
        exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, chunk_rows=96, block_rows=24, kernel="triton")
    # auto keeps the CPU paths on a CPU (the interpreter is for tests)
    from dist_nce.index import exact as ex
    assert ex._fused_usable(DUAL, Reps(q), [Piece(0, Reps(e))], 64, 16, "auto") == "not a CUDA device"
    assert ex._fused_usable(DUAL, Reps(q), [Piece(0, Reps(e))], 64, 16, "triton") is None
