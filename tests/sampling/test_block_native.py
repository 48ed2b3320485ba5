"""The native block kernels (dist_nce/kernels/build.py, block_native): their scores against a plain
float32 reference bit for bit, their block log-masses and log_z against float64, the masks, the
sampler's law (inclusion, ordered pairs, against the dense sampler), sharded == flat and
threads, and the kernel choice (the build: tests/kernels/test_build.py; what only the AVX2
kernel does, fp32 rows and any block size, and the top-k: tests/sampling/test_block_fp32.py).

The searches a shard runs are checked against the references three times: with ``index.kernel
native`` where the AVX512-BF16 kernel runs, with the AVX2 kernel (``DIST_NCE_NATIVE_MASK=avx512_bf16``
makes this machine choose what a CPU without AVX512-BF16 chooses; skipped where neither runs,
with the reason), and with ``auto`` and ``DIST_NCE_NATIVE=off`` on every CPU, which is the torch
path a CPU without either kernel takes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import Piece, _native_calls, exact_search, exact_search_pieces
from dist_nce.index.search import ShardIndex
from dist_nce.kernels import build as native
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling import negatives as ng
from dist_nce.sampling import block_native
from dist_nce.sampling.laws import successive_law, two_sample_p
from dist_nce.sampling.topk import merge_results

NATIVE_REASON = native.unavailable_reason()
AVX2_REASON = native.BLOCK_FP32.unavailable_reason()
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native block kernel unavailable: {NATIVE_REASON}")
DUAL = ScoreSpec.preset("dual")
INF = float("-inf")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["native", "avx2", "fallback"])
def kernel(request, monkeypatch) -> str:
    """The ``index.kernel`` that runs the path under test: native (AVX512-BF16), native with
    AVX512-BF16 masked (the AVX2 kernel), or auto with the kernels off."""
    if request.param == "native" and NATIVE_REASON is not None:
        pytest.skip(f"native block kernel unavailable: {NATIVE_REASON}")
    if request.param == "avx2":
        if AVX2_REASON is not None:
            pytest.skip(f"native AVX2 kernel unavailable: {AVX2_REASON}")
        monkeypatch.setenv(native.MASK, "avx512_bf16")
    if request.param == "fallback":
        monkeypatch.setenv(native.SWITCH, "off")
    return "auto" if request.param == "fallback" else "native"


def sequential_scores(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The kernel's definition in numpy float32: acc += q[2p+1] e[2p+1]; acc += q[2p] e[2p]."""
    qn, en = q.float().numpy(), e.float().numpy()
    acc = np.zeros((qn.shape[0], en.shape[0]), dtype=np.float32)
    for p in range(qn.shape[1] // 2):
        for c in (2 * p + 1, 2 * p):
            acc = acc + np.outer(qn[:, c], en[:, c]).astype(np.float32)  # bf16 x bf16 products are exact
    return torch.from_numpy(acc)


def run_all_blocks(q, e, b, gold=None, dead=None, lo=0, hi=None, threads=1, kernel=block_native.BF16):
    """Keep every block (k = number of blocks): the kernel's scores and block masses of all rows
    (``kernel`` BF16 takes bf16 queries, FP32 takes them as fp32)."""
    q = q.bfloat16() if kernel == block_native.BF16 else q.float()
    hi = e.shape[0] if hi is None else hi
    nb = -(-hi // b) - lo // b
    calls = [block_native.Call(e, 0, lo, hi, lo // b, -(-hi // b), torch.empty(0, dtype=torch.int64),
                               (b * torch.arange(lo // b, -(-hi // b))).clamp(min=lo))]
    out = []
    kept, log_z = block_native.run_calls(calls, q, nb, gold, dead, 1, torch.arange(q.shape[0]), b, threads, out=out,
                                         kernel=kernel)
    full = torch.full((q.shape[0], -(-hi // b) * b), INF)
    for i in range(q.shape[0]):
        for c, sc in zip(kept.counters[i].tolist(), kept.scores[i]):
            if c >= 0:
                full[i, c // b * b:c // b * b + b] = sc
    m = torch.cat([o[1] for o in out], 1).double()
    s = torch.cat([o[2] for o in out], 1).double()
    return full[:, :hi], m + s.log(), log_z


def block_kernel(name: str) -> str:
    """``name`` (BF16 or FP32), skipping the test where that kernel cannot run."""
    reason = block_native.KERNELS[name].unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernel {name} unavailable: {reason}")
    return name


KERNEL_NAMES = [block_native.BF16, block_native.FP32]


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_scores_are_the_sequential_bf16_sums_and_masses_match_float64(name):
    q = (torch.randn(37, 64, generator=gen(1)) * 0.5).bfloat16()  # 37: a partial query tile
    e = (torch.randn(1024, 64, generator=gen(2)) * 0.5).bfloat16()
    scores, log_mass, log_z = run_all_blocks(q, e, 64, kernel=block_kernel(name))
    ref = sequential_scores(q, e)
    assert torch.equal(scores, ref)  # bit for bit: the fixed summation order of VDPBF16PS
    want = torch.logsumexp(ref.double().view(37, 16, 64), -1)
    assert float((log_mass - want).abs().max()) < 2e-6  # float32 sums of exp (block_gumbel's bound)
    assert float((log_z - torch.logsumexp(ref.double(), -1)).abs().max()) < 1e-6


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_gold_dead_and_piece_bounds_are_excluded(name):
    q = (torch.randn(20, 32, generator=gen(3))).bfloat16()
    e = (torch.randn(400, 32, generator=gen(4))).bfloat16()
    gold = torch.stack([torch.arange(20) * 17 + 5, torch.full((20,), -1)], 1)
    gold[3, 1] = 250
    dead = torch.tensor([16, 17, 100, 255, 256, 399])
    lo, hi = 10, 390  # neither on the 16-row grid
    scores, log_mass, log_z = run_all_blocks(q, e, 16, gold=gold, dead=dead, lo=lo, hi=hi, kernel=block_kernel(name))
    ref = sequential_scores(q, e)[:, :hi].clone()
    ref[:, :lo] = INF
    ref[:, dead[dead < hi]] = INF
    for i in range(20):
        for g in gold[i].tolist():
            if 0 <= g < hi:
                ref[i, g] = INF
    assert torch.equal(scores[:, lo:], ref[:, lo:])
    assert (scores[:, :lo] == INF).all()
    want = torch.logsumexp(ref.double(), -1)
    assert float((log_z - want).abs().max()) < 1e-6
    # each whole block's log-mass is its masked logsumexp (block 0 holds only rows 10..15)
    blocks = torch.logsumexp(ref.double()[:, :384].view(20, 24, 16), -1)
    got = log_mass[:, :24]
    finite = torch.isfinite(blocks)
    assert torch.equal(finite, torch.isfinite(got))
    assert float((got[finite] - blocks[finite]).abs().max()) < 2e-6


def test_a_search_excludes_gold_and_dead_rows_and_log_z_is_float64(kernel):
    e, q, gold = _data(n=1000, d=32, batch=24, seed=13)
    gold = torch.stack([gold, torch.full_like(gold, -1)], 1)
    gold[3, 1] = 250
    dead = torch.tensor([16, 17, 100, 255, 256, 999])
    res = exact_search(DUAL, Reps(q), Reps(e), 0, 40, gold, chunk_rows=128, seed=3, query_keys=torch.arange(24),
                       sampler="block", block_rows=16, dead=dead, kernel=kernel)
    ref = q.double() @ e.double().T  # bf16 values: exact products, float64 sums
    ref[:, dead] = INF
    for i, row in enumerate(gold.tolist()):
        ref[i, [g for g in row if g >= 0]] = INF
    assert not torch.isin(res.ids, dead).any() and not (res.ids[:, :, None] == gold[:, None]).any()
    assert float((res.scores.double() - ref.gather(1, res.ids)).abs().max()) < 1e-5
    assert float((res.log_z - torch.logsumexp(ref, -1)).abs().max()) < 1e-5


@pytest.mark.parametrize("layout", [[(0, 40)], [(0, 16), (16, 24), (24, 40)], [(0, 13), (13, 40)]],
                         ids=["flat", "sharded-on-grid", "unaligned"])
def test_block_sampler_draws_the_exact_law(layout, kernel):
    # 40 rows in blocks of 8, K-1 = 3: only 3 of the 5 blocks are kept per draw. Entity i scores
    # s_i against the all-ones query (one non-zero coordinate), row 0 is the gold.
    n, draws, k = 40, 60_000, 3
    s = torch.linspace(-1.5, 2.0, n)[torch.randperm(n, generator=gen(5))].bfloat16().float()
    ents = Reps(torch.diag(s))
    q, gold = torch.ones(draws, n), torch.zeros(draws, dtype=torch.int64)
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, score_dtype="bf16",
                      kernel=kernel)
    res = merge_results([ShardIndex(DUAL, Reps(ents.vecs[a:b]), a, cfg).gumbel_topk(q, k, gold, 17,
                                                                                   torch.arange(draws))
                         for a, b in layout], k)
    assert torch.equal(res.scores, s[res.ids]) and not (res.ids == 0).any()
    law = successive_law(res.ids, s, 1.1)
    assert law["first_draw_p"] > 1e-4 and law["ordered_pairs_p"] > 1e-4  # first draw; p_i p_j / (1 - p_i)
    assert law["wrong_temperature_p"] < 1e-6  # negative control: a wrong temperature is rejected
    assert law["inclusion_max_z"] < 5.0


def test_block_and_dense_samplers_agree_on_ordered_pairs(kernel):
    n, draws = 48, 80_000
    s = torch.randn(n, generator=gen(6)).mul(1.2).bfloat16().float()
    gold = torch.full((draws,), 7)
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, score_dtype="bf16",
                      kernel=kernel)
    native_ids = ShardIndex(DUAL, Reps(torch.diag(s)), 0, cfg).gumbel_topk(torch.ones(draws, n), 2, gold, 3,
                                                                           torch.arange(draws)).ids
    dense_ids = ng.sample_hard(s.expand(draws, n), 2, gold, 4, torch.arange(draws)).ids
    assert two_sample_p(native_ids[:, 0] * n + native_ids[:, 1], dense_ids[:, 0] * n + dense_ids[:, 1], n * n) > 1e-4


def _data(n=3000, d=32, batch=45, seed=7):
    e = (torch.randn(n, d, generator=gen(seed)) * 0.4).bfloat16()
    q = (e[torch.randint(0, n, (batch,), generator=gen(seed + 1))].float()
         + 0.2 * torch.randn(batch, d, generator=gen(seed + 2))).bfloat16().float()
    gold = torch.randint(0, n, (batch,), generator=gen(seed + 3))
    return e, q, gold


def test_sharded_pieces_equal_flat_bit_for_bit(kernel):
    e, q, gold = _data()
    keys = torch.arange(q.shape[0]) * 5 + 1
    kw = dict(chunk_rows=64, seed=9, query_keys=keys, sampler="block", block_rows=16, kernel=kernel)
    dead = torch.tensor([5, 700, 701, 2999])
    flat = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, dead=dead, **kw)
    # shards of whole 16-row blocks, two of them owning two pieces (as KB deltas place new rows):
    # the 64-row chunk [960, 1024) is met by both pieces of the first shard, the rows between
    # them belonging to the second
    parts = [exact_search_pieces(DUAL, Reps(q), [Piece(0, Reps(e[:992])), Piece(1008, Reps(e[1008:1024]))], 20,
                                 gold, dead=dead, **kw),
             exact_search_pieces(DUAL, Reps(q), [Piece(992, Reps(e[992:1008])), Piece(1024, Reps(e[1024:2048]))],
                                 20, gold, dead=dead, **kw),
             exact_search(DUAL, Reps(q), Reps(e[2048:]), 2048, 20, gold, dead=dead, **kw)]
    merged = merge_results(parts, 20)
    assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    assert torch.equal(merged.scores, flat.scores)
    torch.testing.assert_close(merged.log_z, flat.log_z, rtol=1e-13, atol=0)
    assert not torch.isin(flat.ids, dead).any() and not (flat.ids == gold[:, None]).any()


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_threads_do_not_change_the_native_sample(name, monkeypatch):
    # the torch path promises its bits for one thread count only (BLAS picks kernels by it)
    if block_kernel(name) == block_native.FP32:
        monkeypatch.setenv(native.MASK, "avx512_bf16")
    e, q, gold = _data()
    kw = dict(chunk_rows=64, seed=9, query_keys=torch.arange(q.shape[0]) * 5 + 1, sampler="block", block_rows=16,
              kernel="native", dead=torch.tensor([5, 700, 701, 2999]))
    flat = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, **kw)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            again = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, **kw)
            assert torch.equal(again.ids, flat.ids) and torch.equal(again.keys, flat.keys)
            torch.testing.assert_close(again.log_z, flat.log_z, rtol=1e-13, atol=0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_native_and_torch_paths_draw_nearly_the_same_sample(name, monkeypatch):
    # Same law, same counters and noise; the scores differ in their last float32 bits (summation
    # order), so a draw differs only where two keys fall within that rounding of each other.
    if block_kernel(name) == block_native.FP32:
        monkeypatch.setenv(native.MASK, "avx512_bf16")
    e, q, gold = _data(n=6000, d=64, batch=64, seed=11)
    kw = dict(chunk_rows=512, seed=2, query_keys=torch.arange(64), sampler="block", block_rows=64)
    a = exact_search(DUAL, Reps(q), Reps(e), 0, 30, gold, kernel="native", **kw)
    b = exact_search(DUAL, Reps(q), Reps(e), 0, 30, gold, kernel="torch", **kw)
    assert float((a.ids == b.ids).double().mean()) > 0.99
    assert float((a.log_z - b.log_z).abs().max()) < 1e-4


def test_native_refuses_what_it_cannot_serve_on_every_cpu():
    e, q, gold = _data(n=500, d=16, batch=6)
    kw = dict(chunk_rows=64, seed=1, query_keys=torch.arange(6), sampler="block", block_rows=16, kernel="native")
    som = ScoreSpec.preset("som")
    with pytest.raises(ValueError, match="index.kernel 'native': the score is not a single-vector dot product"):
        exact_search(som, Reps(q[:, None]), Reps(e[:, None]), 0, 5, gold, **kw)
    with pytest.raises(ValueError, match="block_lse: the entity rows are not bf16.*; block_fp32: the entity rows are "
                                         "torch.float16, not fp32 or bf16"):
        exact_search(DUAL, Reps(q), Reps(e.half()), 0, 5, gold, **kw)
    with pytest.raises(ValueError, match="block_lse: the entity rows are not bf16.*; block_fp32: the queries are "
                                         r"torch.float16, not fp32 \(index.compute fp32\)"):
        exact_search(DUAL, Reps(q), Reps(e.float()), 0, 5, gold, compute=torch.float16, **kw)
    # what the AVX512-BF16 kernel refuses, fp32 rows and queries that are not bf16 values (storage bf16
    # without score_dtype), the AVX2 kernel serves where it runs
    for rows, queries in ((e.float(), q), (e, q + 1e-3)):
        assert block_native.usable(True, queries, rows, 16, block_native.BF16) is not None
        assert block_native.usable(True, queries, rows, 16, block_native.FP32) == (
            None if AVX2_REASON is None else f"the kernel is unavailable on this machine ({AVX2_REASON})")


@needs_native
def test_native_refuses_blocks_off_its_microtile(monkeypatch):
    e, q, gold = _data(n=500, d=16, batch=6)
    monkeypatch.setenv(native.MASK, "avx2")  # the AVX2 kernel, which takes any block size, ruled out
    with pytest.raises(ValueError, match="block_rows=12 is not a multiple of 8"):
        exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, chunk_rows=48, seed=1, query_keys=torch.arange(6),
                     sampler="block", block_rows=12, kernel="native")


@pytest.mark.parametrize("rows", ["bf16", "fp32"])
@pytest.mark.parametrize("search", ["block", "topk"])
def test_switch_off_selects_the_torch_path(monkeypatch, search, rows):
    # on every CPU, also where the kernels run: auto takes the torch path without calling either
    # kernel, and native says why neither can run
    e, q, gold = _data(n=500, d=16, batch=6)
    e = e if rows == "bf16" else e.float()
    kw = dict(chunk_rows=64, block_rows=16)
    if search == "block":
        kw.update(seed=1, query_keys=torch.arange(6), sampler="block")
    torch_path = exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="torch", **kw)
    monkeypatch.setenv(native.SWITCH, "off")
    for kernel in (native.BLOCK, native.BLOCK_FP32):
        monkeypatch.setattr(kernel, "exercised", False)
    assert native.unavailable_reason() == "DIST_NCE_NATIVE=off" and not native.available()
    assert native.BLOCK_FP32.unavailable_reason() == "DIST_NCE_NATIVE=off"
    auto = exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="auto", **kw)
    assert not native.BLOCK.exercised and not native.BLOCK_FP32.exercised
    for got, want in zip(auto[:4], torch_path[:4]):  # ids, scores, keys, log_z
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"block_fp32: the kernel is unavailable on this machine "
                                         r"\(DIST_NCE_NATIVE=off\)"):
        exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="native", **kw)
    with pytest.raises(native.NativeUnavailable, match="DIST_NCE_NATIVE=off"):
        native.library()


def test_calls_read_pieces_in_place_and_copy_only_shared_chunks():
    e = torch.randn(300, 8).bfloat16()
    pieces = [Piece(0, Reps(e[:100])), Piece(104, Reps(e[104:300])), Piece(100, Reps(e[100:104]))]
    pieces = sorted(pieces, key=lambda p: p.row_start)
    calls = _native_calls(pieces, 32, 8, 1)
    assert [(c.lo, c.hi) for c in calls] == [(0, 96), (96, 128), (128, 300)]
    assert calls[0].ent is pieces[0].reps.vecs and calls[2].ent is pieces[2].reps.vecs
    assert calls[1].exclude.numel() == 0 and calls[1].ent.shape == (32, 8)  # the pieces tile rows 96..128
    assert torch.equal(calls[1].ent[:4], e[96:100]) and torch.equal(calls[1].ent[4:8], e[100:104])
    split = _native_calls([Piece(0, Reps(e))], 32, 8, 3)
    assert len(split) == 3 and [c.lo for c in split] == [0, 128, 256]


def test_strided_rows_draw_what_contiguous_rows_draw(kernel):
    e, q, gold = _data(n=512, d=16, batch=5)
    kw = dict(chunk_rows=64, seed=4, query_keys=torch.arange(5), sampler="block", block_rows=16, kernel=kernel)
    wide = torch.zeros(512, 32, dtype=torch.bfloat16)
    wide[:, ::2] = e  # a strided view of the same values
    a = exact_search(DUAL, Reps(q), Reps(e), 0, 7, gold, **kw)
    b = exact_search(DUAL, Reps(q), Reps(wide[:, ::2]), 0, 7, gold, **kw)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.keys, b.keys)


def test_bad_calls_are_refused_before_the_kernel_loads():
    e, q, gold = _data(n=512, d=16, batch=5)
    bad = block_native.Call(e[:100], 0, 0, 128, 0, 8, torch.empty(0, dtype=torch.int64), torch.arange(8) * 16)
    with pytest.raises(ValueError, match=r"bad call rows \[0, 128\) over torch.bfloat16 \[100, 16\]"):
        block_native.run_calls([bad], q.bfloat16(), 3, gold, None, 1, torch.arange(5), 16)
