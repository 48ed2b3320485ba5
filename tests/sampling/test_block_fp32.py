"""The AVX2 + FMA block kernel (native/block_fp32.c, block_native.FP32) where it differs from the
AVX512-BF16 one (tests/sampling/test_block_native.py runs the shared tests on both): fp32 rows
scored as its documented sequence of FMAs (against exact rational arithmetic), bf16 rows drawing
the AVX512-BF16 kernel's sample bit for bit, any block size, the exact top-k of both kernels
against the torch path (ties included), the law on fp32 rows, and the choice ``index.kernel
auto`` makes from the CPU's flags (faked, or hidden by ``DIST_NCE_NATIVE_MASK``).

Every test that runs a kernel is skipped, with the reason, where that kernel cannot run; the
choice tests run on every CPU (a faked AVX2-only CPU still needs this one to have AVX2 to load
the kernel, and is skipped otherwise)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from dist_nce.index.config import IndexConfig
from dist_nce.index.exact import Piece, exact_search, exact_search_pieces
from dist_nce.index.search import ShardIndex
from dist_nce.kernels import build as native
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling import block_native
from dist_nce.sampling import negatives as ng
from dist_nce.sampling.laws import successive_law, two_sample_p
from dist_nce.sampling.topk import merge_results

DUAL = ScoreSpec.preset("dual")
INF = float("-inf")
FP32_REASON = native.BLOCK_FP32.unavailable_reason()
BF16_REASON = native.BLOCK.unavailable_reason()
needs_fp32 = pytest.mark.skipif(FP32_REASON is not None, reason=f"native AVX2 kernel unavailable: {FP32_REASON}")
AVX2_LAPTOP = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2".split())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fma32(a: float, b: float, c: float) -> np.float32:
    """fl32(a * b + c) rounded once, to nearest, ties to even (exact rational arithmetic)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = np.float32(float(exact))  # within one float32 step of the exact value
    steps = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(steps, key=lambda y: (abs(Fraction(float(y)) - exact), int(np.float32(y).view(np.uint32)) & 1))


def fma_scores(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The kernel's definition: acc = fma(q[2p+1], e[2p+1], acc); acc = fma(q[2p], e[2p], acc) for
    p ascending, then the last dimension of an odd d."""
    d = q.shape[1]
    order = [c for p in range(d // 2) for c in (2 * p + 1, 2 * p)] + ([d - 1] if d % 2 else [])
    out = torch.empty(q.shape[0], e.shape[0])
    for i, qi in enumerate(q.tolist()):
        for j, ej in enumerate(e.tolist()):
            acc = np.float32(0.0)
            for c in order:
                acc = fma32(qi[c], ej[c], float(acc))
            out[i, j] = float(acc)
    return out


def all_blocks(q, e, b, gold=None, dead=None, lo=0, hi=None):
    """Every block kept (k = their number): the FP32 kernel's scores [B, hi] (-inf where excluded),
    block log-masses [B, nb] and log_z."""
    hi = e.shape[0] if hi is None else hi
    j0, j1 = lo // b, -(-hi // b)
    calls = [block_native.Call(e, 0, lo, hi, j0, j1, torch.empty(0, dtype=torch.int64),
                               (b * torch.arange(j0, j1)).clamp(min=lo))]
    out = []
    kept, log_z = block_native.run_calls(calls, q.float(), j1 - j0, gold, dead, 1, torch.arange(q.shape[0]), b,
                                         out=out, kernel=block_native.FP32)
    full = torch.full((q.shape[0], j1 * b), INF)
    for i in range(q.shape[0]):
        for c, sc in zip(kept.counters[i].tolist(), kept.scores[i]):
            if c >= 0:
                full[i, c // b * b:c // b * b + b] = sc
    return full[:, :hi], out[0][1].double() + out[0][2].double().log(), log_z


@needs_fp32
@pytest.mark.parametrize("d", [9, 10])
def test_fp32_rows_are_scored_as_the_documented_fmas(d):
    q = torch.randn(5, d, generator=gen(1))
    e = torch.randn(40, d, generator=gen(2)) * 3
    scores, log_mass, log_z = all_blocks(q, e, 8)
    want = fma_scores(q, e)
    assert torch.equal(scores, want)  # bit for bit: one rounding per FMA, fixed order
    ref = want.double()  # the masses of those scores, to float32 rounding of the sums of exp
    assert float((log_mass - torch.logsumexp(ref.view(5, 5, 8), -1)).abs().max()) < 2e-6
    assert float((log_z - torch.logsumexp(ref, -1)).abs().max()) < 1e-6


@needs_fp32
@pytest.mark.parametrize("b", [5, 12, 13])
def test_any_block_size_scores_and_masks_every_row(b):
    # the micro-tile holds 6 rows: blocks of other sizes end on a partial one
    q = torch.randn(19, 16, generator=gen(3))
    e = (torch.randn(300, 16, generator=gen(4)) * 0.5).bfloat16().float()  # bf16 values: exact products
    gold = torch.arange(19) * 11 + 3
    dead = torch.tensor([0, 7, 100, 101, 299])
    lo, hi = 4, 297
    scores, log_mass, log_z = all_blocks(q.bfloat16(), e, b, gold=gold, dead=dead, lo=lo, hi=hi)
    qb = q.bfloat16().float()
    ref = torch.zeros(19, 300)
    for c in [c for p in range(8) for c in (2 * p + 1, 2 * p)]:  # exact products, fp32 sums in order
        ref = ref + torch.outer(qb[:, c], e[:, c])
    ref = ref[:, :hi].clone()
    ref[:, :lo] = INF
    ref[:, dead[dead < hi]] = INF
    ref[torch.arange(19), gold] = INF
    assert torch.equal(scores, ref)
    assert float((log_z - torch.logsumexp(ref.double(), -1)).abs().max()) < 1e-6
    whole = hi // b * b  # the whole blocks' log-masses (the first starts at row 0 < lo: a piece)
    want = torch.logsumexp(ref.double()[:, :whole].view(19, -1, b), -1)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(log_mass[:, :whole // b]))
    assert float((log_mass[:, :whole // b][finite] - want[finite]).abs().max()) < 2e-6


def _data(n=3000, d=32, batch=45, seed=7, ties=False):
    e = (torch.randn(n, d, generator=gen(seed)) * 0.4).bfloat16()
    q = (e[torch.randint(0, n, (batch,), generator=gen(seed + 1))].float()
         + 0.2 * torch.randn(batch, d, generator=gen(seed + 2))).bfloat16().float()
    if ties:  # integer scores: exact in any summation order, many exact ties across blocks and shards
        e = torch.randint(-2, 3, (n, d), generator=gen(seed)).bfloat16()
        q = torch.randint(-1, 2, (batch, d), generator=gen(seed + 2)).float()
    gold = torch.randint(0, n, (batch, 2), generator=gen(seed + 3))
    gold[::3, 1] = -1
    return e, q, gold


def use_kernel(name: str, monkeypatch) -> str:
    """Make ``index.kernel native`` run ``name``: the AVX512-BF16 kernel, or the AVX2 one (AVX512-BF16
    masked); skips where it cannot run."""
    reason = block_native.KERNELS[name].unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernel {name} unavailable: {reason}")
    if name == block_native.FP32:
        monkeypatch.setenv(native.MASK, "avx512_bf16")
    return name


@pytest.fixture(params=[block_native.BF16, block_native.FP32])
def kernel(request, monkeypatch) -> str:
    return use_kernel(request.param, monkeypatch)


@pytest.mark.parametrize("name,rows", [(block_native.BF16, "bf16"), (block_native.FP32, "bf16"),
                                       (block_native.FP32, "fp32")])
def test_topk_equals_the_torch_path_ties_included(name, rows, monkeypatch):
    kernel = use_kernel(name, monkeypatch)
    e, q, gold = _data(n=1000, ties=True)
    e = e if rows == "bf16" else e.float()
    dead = torch.tensor([3, 64, 65, 999])
    kw = dict(chunk_rows=128, block_rows=16, dead=dead)
    want = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="torch", **kw)
    monkeypatch.setattr(block_native.KERNELS[kernel], "exercised", False)
    got = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="native", **kw)
    assert block_native.KERNELS[kernel].exercised
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    assert torch.equal(got.keys, want.keys)
    torch.testing.assert_close(got.log_z, want.log_z, rtol=1e-6, atol=1e-6)
    parts = [exact_search(DUAL, Reps(q), Reps(e[a:b]), a, 20, gold, kernel="native", **kw)
             for a, b in [(0, 200), (200, 203), (203, 1000)]]  # off the block grid: still exact
    merged = merge_results(parts, 20)
    assert torch.equal(merged.ids, want.ids) and torch.equal(merged.scores, want.scores)
    short = exact_search(DUAL, Reps(q), Reps(e[:7]), 0, 9, gold, kernel="native", **kw)  # fewer rows than k
    assert (short.ids[:, 7:] == -1).all() and (short.keys[short.ids < 0] == INF).all()


def test_topk_of_real_scores_is_the_reference_topk_of_the_kernels_scores(kernel):
    # non-integer scores: the kernel's top-k is the exact top-k (score desc, row asc) of its own scores
    e, q, gold = _data(n=2000, d=16, batch=21, seed=5)
    got = exact_search(DUAL, Reps(q), Reps(e), 0, 30, gold, chunk_rows=256, block_rows=32, kernel="native")
    scores = torch.zeros(21, 2000)
    qb, eb = q.bfloat16().float(), e.float()
    for c in [c for p in range(8) for c in (2 * p + 1, 2 * p)]:  # both kernels' sequence of exact products
        scores = scores + torch.outer(qb[:, c], eb[:, c])
    want = ng.gumbel_topk_dense(scores, 30, gold, None, None)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)
    assert float((got.log_z - want.log_z).abs().max()) < 1e-5


@pytest.mark.skipif(FP32_REASON is not None or BF16_REASON is not None,
                    reason=f"needs both kernels: {FP32_REASON or BF16_REASON}")
@pytest.mark.parametrize("seed", [None, 9])
def test_bf16_rows_draw_the_avx512_kernels_sample_bit_for_bit(monkeypatch, seed):
    # the same products in the same order, the same exp, the same float64 mass: a fleet mixing
    # AVX512-BF16 and AVX2 machines draws what one kind of machine draws
    e, q, gold = _data(n=3000, d=32, batch=45)
    kw = dict(chunk_rows=64, block_rows=16, kernel="native", dead=torch.tensor([5, 700, 701, 2999]))
    if seed is not None:
        kw.update(seed=seed, query_keys=torch.arange(45) * 5 + 1, sampler="block")

    def search():
        return merge_results([exact_search_pieces(DUAL, Reps(q), [Piece(0, Reps(e[:992])),
                                                                  Piece(1008, Reps(e[1008:1024]))], 20, gold, **kw),
                              exact_search(DUAL, Reps(q), Reps(e[992:1008]), 992, 20, gold, **kw),
                              exact_search(DUAL, Reps(q), Reps(e[1024:]), 1024, 20, gold, **kw)], 20)

    avx512 = search()
    monkeypatch.setenv(native.MASK, "avx512_bf16")
    monkeypatch.setattr(native.BLOCK_FP32, "exercised", False)
    avx2 = search()
    assert native.BLOCK_FP32.exercised
    for got, want in zip(avx2[:4], avx512[:4]):  # ids, scores, keys, log_z
        assert torch.equal(got, want)


@needs_fp32
@pytest.mark.parametrize("layout", [[(0, 40)], [(0, 16), (16, 24), (24, 40)], [(0, 13), (13, 40)]],
                         ids=["flat", "sharded-on-grid", "unaligned"])
def test_fp32_rows_draw_the_exact_law(layout):
    # 40 rows in blocks of 8, K-1 = 3; entity i scores s_i (fp32, not bf16 values) against the
    # all-ones query: one non-zero product, so the kernel's score is s_i exactly. Row 0 is the gold.
    n, draws, k = 40, 60_000, 3
    s = torch.linspace(-1.5, 2.0, n)[torch.randperm(n, generator=gen(5))] + 1e-3
    ents = Reps(torch.diag(s))
    q, gold = torch.ones(draws, n), torch.zeros(draws, dtype=torch.int64)
    cfg = IndexConfig(backend="torch", chunk_rows=16, sampler="block", block_rows=8, kernel="native")
    res = merge_results([ShardIndex(DUAL, Reps(ents.vecs[a:b]), a, cfg).gumbel_topk(q, k, gold, 17,
                                                                                   torch.arange(draws))
                         for a, b in layout], k)
    assert torch.equal(res.scores, s[res.ids]) and not (res.ids == 0).any()
    law = successive_law(res.ids, s, 1.1)
    assert law["first_draw_p"] > 1e-4 and law["ordered_pairs_p"] > 1e-4  # first draw; p_i p_j / (1 - p_i)
    assert law["wrong_temperature_p"] < 1e-6  # negative control: a wrong temperature is rejected
    assert law["inclusion_max_z"] < 5.0
    dense = ng.sample_hard(s.expand(draws, n), k, gold, 4, torch.arange(draws)).ids
    assert two_sample_p(res.ids[:, 0] * n + res.ids[:, 1], dense[:, 0] * n + dense[:, 1], n * n) > 1e-4


@needs_fp32
def test_fp32_sharded_equals_flat_and_torch_draws_nearly_the_same(monkeypatch):
    e, q, gold = _data(n=3000, d=24, batch=33, seed=8)
    e = e.float() + 1e-3 * torch.randn(3000, 24, generator=gen(9))  # fp32 rows, not bf16 values
    q = q + 1e-3
    kw = dict(chunk_rows=64, seed=9, query_keys=torch.arange(33) * 5 + 1, sampler="block", block_rows=16)
    flat = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="native", **kw)
    parts = [exact_search(DUAL, Reps(q), Reps(e[a:b]), a, 20, gold, kernel="native", **kw)
             for a, b in [(0, 992), (992, 1008), (1008, 3000)]]
    merged = merge_results(parts, 20)
    assert torch.equal(merged.ids, flat.ids) and torch.equal(merged.keys, flat.keys)
    torch.testing.assert_close(merged.log_z, flat.log_z, rtol=1e-13, atol=0)
    ref = exact_search(DUAL, Reps(q), Reps(e), 0, 20, gold, kernel="torch", **kw)  # same law, BLAS's rounding
    assert float((ref.ids == flat.ids).double().mean()) > 0.99
    assert float((ref.log_z - flat.log_z).abs().max()) < 1e-4


def _choice(rows: torch.Tensor, queries: torch.Tensor) -> tuple[str | None, str | None]:
    return block_native.choose(True, queries, rows, 16)


def test_auto_chooses_the_kernel_the_cpu_flags_allow(monkeypatch):
    monkeypatch.delenv(native.SWITCH, raising=False)
    monkeypatch.delenv(native.MASK, raising=False)
    e, q, gold = _data(n=500, d=16, batch=6)
    bf16_rows, fp32_rows = (e, q), (e.float(), q + 1e-3)
    # no AVX: neither kernel, whatever the rows; auto is the torch path and native says why
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2"}))
    for rows, queries in (bf16_rows, fp32_rows):
        name, why = _choice(rows, queries)
        assert name is None
        assert "block_fp32: the kernel is unavailable on this machine (this CPU lacks avx2, fma)" in why
    kw = dict(chunk_rows=64, seed=1, query_keys=torch.arange(6), sampler="block", block_rows=16)
    for kernel in block_native.KERNELS.values():
        monkeypatch.setattr(kernel, "exercised", False)
    auto = exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="auto", **kw)
    want = exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="torch", **kw)
    assert all(torch.equal(a, b) for a, b in zip(auto[:4], want[:4]))
    assert not any(kernel.exercised for kernel in block_native.KERNELS.values())
    with pytest.raises(ValueError, match=r"index.kernel 'native': block_lse: .*this CPU lacks avx512f"):
        exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="native", **kw)
    if FP32_REASON is not None:
        return  # the rest loads the AVX2 kernel on this machine
    # an AVX2 laptop: the AVX2 kernel for bf16 and fp32 rows
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_LAPTOP)
    assert _choice(*bf16_rows) == (block_native.FP32, None) and _choice(*fp32_rows) == (block_native.FP32, None)
    exact_search(DUAL, Reps(q), Reps(e), 0, 5, gold, kernel="auto", **kw)
    assert native.BLOCK_FP32.exercised and not native.BLOCK.exercised
    # ... and with AVX2 hidden by the mask, torch again
    monkeypatch.setenv(native.MASK, "avx2")
    assert _choice(*fp32_rows)[1] == ("block_lse: the entity rows are not bf16 (index.score_dtype bf16); block_fp32: "
                                      "the kernel is unavailable on this machine (DIST_NCE_NATIVE_MASK hides avx2)")
    # this machine's own flags with AVX512-BF16 hidden: bf16 rows go to the AVX2 kernel
    monkeypatch.setattr(native, "cpu_flags", lambda: AVX2_LAPTOP | set(native.REQUIRED_FLAGS))
    monkeypatch.setenv(native.MASK, "avx512_bf16")
    assert _choice(*bf16_rows) == (block_native.FP32, None)
    monkeypatch.delenv(native.MASK)
    if BF16_REASON is None:  # where the AVX512-BF16 kernel runs it wins for bf16 rows, the AVX2 one takes fp32
        assert _choice(*bf16_rows) == (block_native.BF16, None) and _choice(*fp32_rows) == (block_native.FP32, None)


@needs_fp32
def test_shard_index_topk_and_block_sampler_take_the_kernel_by_default(monkeypatch):
    e, q, gold = _data(n=600, d=16, batch=8)
    idx = ShardIndex(DUAL, Reps(e.float()), 0, IndexConfig(backend="torch", sampler="block", block_rows=16,
                                                          chunk_rows=64))
    monkeypatch.setattr(native.BLOCK_FP32, "exercised", False)
    top = idx.topk(q, 10, gold[:, 0], dead=torch.tensor([1, 2, 3]))
    assert native.BLOCK_FP32.exercised
    want = ShardIndex(DUAL, Reps(e.float()), 0, IndexConfig(backend="torch", kernel="torch")).topk(
        q, 10, gold[:, 0], dead=torch.tensor([1, 2, 3]))
    assert torch.equal(top.ids, want.ids)  # bf16 values: exact in both summation orders
    drawn = idx.gumbel_topk(q, 10, gold[:, 0], 3, torch.arange(8))
    assert not (drawn.ids == gold[:, :1]).any() and (drawn.ids >= 0).all()
