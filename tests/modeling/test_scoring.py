"""dist_nce.modeling.scoring against slow, obviously correct references.

The references loop over (mention, entity) pairs in float64 and compute each preset's
closed form from the paper, or the general trace form with explicit Q, K and Attn
matrices; the fast batched paths must agree with both.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from dist_nce.modeling.scoring import (
    Reps,
    ScoreSpec,
    entity_reps,
    flatten_for_mips,
    is_inner_product,
    mention_reps,
    score_all,
    score_candidates,
)

D = 8
M = 3  # m for poly / multi / genpoly
PRESETS = [("dual", None), ("poly", M), ("multi", M), ("som", None), ("genpoly", M)]


def _spec(name, m):
    return ScoreSpec.preset(name, m=m)


def _lengths_mask(lengths, t):
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def _data(seed=0, b=3, t=6, n=5, t2=7):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(b, t, D, generator=g)
    F = torch.randn(n, t2, D, generator=g)
    emask = _lengths_mask([t, 2, 4][:b] + [t] * max(0, b - 3), t)
    # entity 1 is shorter than m, so leftmost-m reductions meet padding
    flens = [t2, 2, 5, 1, t2][:n] + [t2] * max(0, n - 5)
    fmask = _lengths_mask(flens, t2)
    codes = torch.randn(M, D, generator=g)
    return E, emask, F, fmask, codes


# ------------------------------------------------------------------ references


def _code_vectors(h, mask, codes):
    """c_j = sum_t softmax_t(code_j . h_t) h_t over real t."""
    real = h[mask]
    return [torch.softmax(real @ c, 0) @ real for c in codes]


def _closed_form(name, e, em, f, fm, codes):
    """The paper's formula for one (mention, entity) pair, in float64."""
    e, f, codes = e.double(), f.double(), codes.double()
    ereal, freal = e[em], f[fm]
    if name == "dual":
        return e[0] @ f[0]
    if name == "multi":
        return max(e[0] @ f[t] for t in range(min(M, len(freal))))
    if name == "som":
        return sum(max(x @ y for y in freal) for x in ereal)
    cs = _code_vectors(e, em, codes)
    queries = [f[0]] if name == "poly" else [f[t] for t in range(min(M, len(freal)))]
    total = 0.0
    for q in queries:  # C_m(x, y) column for query q: softmax over codes of c_j . q
        w = torch.softmax(torch.stack([c @ q for c in cs]), 0)
        total = total + q @ sum(wj * c for wj, c in zip(w, cs))
    return total


def _columns(h, mask, red, count, codes):
    if red == "all":
        return h[mask].T
    if red == "codes":
        return torch.stack(_code_vectors(h, mask, codes), 1)
    return h[: min(count, int(mask.sum()))].T  # leftmost real columns (right padding)


def _general_form(spec, e, em, f, fm, codes):
    """trace(Q_m^T K_m' Attn(K_m'^T Q_m)) with explicit matrices, float64."""
    e, f, codes = e.double(), f.double(), codes.double()
    x_cols = _columns(e, em, *spec.mention_side, codes)
    y_cols = _columns(f, fm, *spec.entity_side, None)
    Q, K = (x_cols, y_cols) if spec.direction == "x->y" else (y_cols, x_cols)
    S = K.T @ Q  # [m', m]
    if spec.attention == "soft":
        A = torch.softmax(S, dim=0)
    else:
        A = torch.nn.functional.one_hot(S.argmax(0), S.shape[0]).T.double()
    return torch.trace(Q.T @ K @ A)


def _pairwise(fn, *args):
    E, emask, F, fmask, codes = args
    return torch.tensor([[float(fn(E[i], emask[i], F[j], fmask[j], codes)) for j in range(len(F))]
                         for i in range(len(E))], dtype=torch.float64)


def _fast_all(spec, E, emask, F, fmask, codes, **kw):
    uses_codes = spec.mention_side.reduction == "codes"
    m = mention_reps(spec, E, emask, codes if uses_codes else None)
    return score_all(spec, m, entity_reps(spec, F, fmask), **kw)


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("name,m", PRESETS)
def test_preset_equals_closed_form_and_general_form(name, m):
    data = _data()
    spec = _spec(name, m)
    closed = _pairwise(lambda *a: _closed_form(name, *a), *data)
    general = _pairwise(lambda *a: _general_form(spec, *a), *data)
    torch.testing.assert_close(general, closed, rtol=1e-10, atol=1e-10)
    fast = _fast_all(spec, *data)
    assert fast.dtype == torch.float32 and fast.shape == closed.shape
    torch.testing.assert_close(fast.double(), closed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "direction,qred,qn,kred,kn,attention",
    [("x->y", "first", 2, "all", None, "soft"), ("y->x", "all", None, "first", 3, "hard"),
     ("x->y", "codes", 3, "first", 2, "soft"), ("y->x", "first", 1, "all", None, "hard")],
)
def test_general_specs_beyond_presets(direction, qred, qn, kred, kn, attention):
    spec = ScoreSpec(direction, qred, qn, kred, kn, attention)
    E, emask, F, fmask, codes = _data(seed=1)
    ref = _pairwise(lambda *a: _general_form(spec, *a), E, emask, F, fmask, codes)
    fast = _fast_all(spec, E, emask, F, fmask, codes)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)


def test_entity_side_codes():
    spec = ScoreSpec("x->y", "first", 1, "codes", M, "soft")
    E, emask, F, fmask, codes = _data(seed=2)
    fast = score_all(spec, mention_reps(spec, E, emask), entity_reps(spec, F, fmask, codes=codes))
    # by symmetry of the reference, swap roles: entity codes over F, mention CLS as query
    ref = torch.tensor([[float(_general_form(ScoreSpec("y->x", "first", 1, "codes", M, "soft"),
                                             F[j], fmask[j], E[i], emask[i], codes))
                         for j in range(len(F))] for i in range(len(E))], dtype=torch.float64)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ padding


def _pad_with_garbage(h, mask, extra, seed):
    """Append `extra` padded positions and overwrite every padded slot with junk."""
    g = torch.Generator().manual_seed(seed)
    h = torch.cat([h, torch.zeros(h.shape[0], extra, h.shape[2])], 1)
    mask = torch.cat([mask, torch.zeros(mask.shape[0], extra, dtype=torch.bool)], 1)
    junk = 100 * torch.randn(h.shape, generator=g)
    return torch.where(mask[..., None], h, junk), mask


@pytest.mark.parametrize("name,m", PRESETS)
def test_padding_never_changes_a_score(name, m):
    E, emask, F, fmask, codes = _data(seed=3)
    spec = _spec(name, m)
    base = _fast_all(spec, E, emask, F, fmask, codes)
    E2, emask2 = _pad_with_garbage(E, emask, 4, seed=10)
    F2, fmask2 = _pad_with_garbage(F, fmask, 5, seed=11)
    padded = _fast_all(spec, E2, emask2, F2, fmask2, codes)
    torch.testing.assert_close(padded, base, rtol=1e-5, atol=1e-5)
    # and the candidate path sees the same
    mr = mention_reps(spec, E2, emask2, codes if spec.mention_side.reduction == "codes" else None)
    er = entity_reps(spec, F2, fmask2)
    cand = Reps(er.vecs[None].expand(len(E), *er.vecs.shape),
                None if er.mask is None else er.mask[None].expand(len(E), *er.mask.shape))
    torch.testing.assert_close(score_candidates(spec, mr, cand), base, rtol=1e-5, atol=1e-5)


def test_padding_gets_no_gradient():
    E, emask, F, fmask, _ = _data(seed=4)
    spec = _spec("som", None)
    E, F = E.requires_grad_(), F.requires_grad_()
    score_all(spec, mention_reps(spec, E, emask), entity_reps(spec, F, fmask)).sum().backward()
    assert E.grad[~emask].abs().max() == 0 and F.grad[~fmask].abs().max() == 0
    assert E.grad[emask].abs().max() > 0 and F.grad[fmask].abs().max() > 0


def test_leftmost_m_pads_short_encodings():
    spec = _spec("multi", 4)
    F = torch.randn(2, 3, D)  # T=3 < m=4 (the encoder trimmed padding)
    reps = entity_reps(spec, F, torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool))
    assert reps.vecs.shape == (2, 4, D)
    assert reps.mask.tolist() == [[True, True, True, False], [True, True, False, False]]


# ------------------------------------------------------------------ batched paths


@pytest.mark.parametrize("name,m", PRESETS)
def test_score_candidates_agrees_with_score_all(name, m):
    E, emask, F, fmask, codes = _data(seed=5, b=4, n=6)
    spec = _spec(name, m)
    mr = mention_reps(spec, E, emask, codes if spec.mention_side.reduction == "codes" else None)
    er = entity_reps(spec, F, fmask)
    full = score_all(spec, mr, er)
    idx = torch.randint(0, len(F), (len(E), 5), generator=torch.Generator().manual_seed(0))
    cand = Reps(er.vecs[idx], None if er.mask is None else er.mask[idx])
    torch.testing.assert_close(score_candidates(spec, mr, cand), full.gather(1, idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,m", PRESETS)
def test_chunking_does_not_change_scores(name, m):
    data = _data(seed=6, n=7)
    spec = _spec(name, m)
    whole = _fast_all(spec, *data)
    for chunk in (1, 3, 100):
        torch.testing.assert_close(_fast_all(spec, *data, chunk_size=chunk), whole, rtol=1e-6, atol=1e-6)
    empty = score_all(spec, mention_reps(spec, data[0], data[1], data[4] if name in ("poly", "genpoly") else None),
                      entity_reps(spec, data[2][:0], data[3][:0]))
    assert empty.shape == (3, 0)


@pytest.mark.parametrize("name,m", PRESETS)
def test_gradients_match_finite_differences(name, m):
    E, emask, F, fmask, codes = (x.double() if x.is_floating_point() else x for x in _data(seed=7, b=2, n=3))
    spec = _spec(name, m)
    uses_codes = spec.mention_side.reduction == "codes"

    def fn(E, F, codes):
        mr = mention_reps(spec, E, emask, codes if uses_codes else None)
        er = entity_reps(spec, F, fmask)
        cand = Reps(er.vecs[None].expand(2, *er.vecs.shape),
                    None if er.mask is None else er.mask[None].expand(2, *er.mask.shape))
        return score_candidates(spec, mr, cand)

    inputs = (E.requires_grad_(), F.requires_grad_(), codes.requires_grad_())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)
    fn(*inputs).sum().backward()
    assert E.grad.abs().sum() > 0 and F.grad.abs().sum() > 0
    if uses_codes:
        assert codes.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,m", PRESETS)
def test_half_precision_within_tolerance_of_fp32(name, m, dtype):
    E, emask, F, fmask, codes = _data(seed=8, b=4, t=16, n=9, t2=16)
    spec = _spec(name, m)
    ref = _fast_all(spec, E, emask, F, fmask, codes)
    low = _fast_all(spec, E.to(dtype), emask, F.to(dtype), fmask, codes.to(dtype))
    assert low.dtype == torch.float32
    scale = ref.abs().max()
    # a few units of roundoff of the input format: bf16 2^-8, fp16 2^-11 (relative)
    tol = 5 * 2.0**-8 if dtype == torch.bfloat16 else 8 * 2.0**-11
    assert (low - ref).abs().max() <= tol * scale, (low - ref).abs().max() / scale


# ------------------------------------------------------------------ MIPS


def _grouped_max(u, mips, n):
    s = u @ mips.vecs.T
    out = torch.full((u.shape[0], n), float("-inf"))
    return out.scatter_reduce(1, mips.owners[None].expand_as(s), s, reduce="amax")


@pytest.mark.parametrize(
    "spec",
    [ScoreSpec.preset("dual"), ScoreSpec.preset("multi", m=M), ScoreSpec("y->x", "first", 3, "first", 1, "soft")],
    ids=str,
)
def test_flatten_for_mips_reproduces_exact_scores(spec):
    E, emask, F, fmask, _ = _data(seed=9, n=6)
    assert is_inner_product(spec)
    mr, er = mention_reps(spec, E, emask), entity_reps(spec, F, fmask)
    mips = flatten_for_mips(spec, er)
    assert mips.owners.dtype == torch.int64 and mips.vecs.shape[0] == mips.owners.shape[0]
    torch.testing.assert_close(_grouped_max(mr.vecs, mips, len(F)), score_all(spec, mr, er), rtol=1e-5, atol=1e-5)


def test_multi_mips_drops_padded_vectors():
    spec = ScoreSpec.preset("multi", m=M)
    _, _, F, fmask, _ = _data()
    mips = flatten_for_mips(spec, entity_reps(spec, F, fmask))
    assert mips.owners.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("name,m", [("poly", M), ("som", None), ("genpoly", M)])
def test_non_inner_product_presets_refuse_mips(name, m):
    spec = _spec(name, m)
    assert not is_inner_product(spec)
    with pytest.raises(ValueError, match="not a maximum inner product"):
        flatten_for_mips(spec, Reps(torch.zeros(2, D)))


# ------------------------------------------------------------------ spec + errors


def test_preset_settings():
    assert ScoreSpec.preset("poly", m=4).mention_side == ("codes", 4)
    assert ScoreSpec.preset("poly", m=4).entity_side == ("first", 1)
    assert ScoreSpec.preset("genpoly", m=4).entity_side == ("first", 4)
    assert ScoreSpec.preset("multi", m=4) == ScoreSpec("x->y", "first", 1, "first", 4, "hard")
    assert str(ScoreSpec.preset("som")) == "ScoreSpec(x->y, Q=all, K=all, hard)"


@pytest.mark.parametrize(
    "call,match",
    [(lambda: ScoreSpec.preset("colbert"), "unknown score preset"),
     (lambda: ScoreSpec.preset("poly"), "needs m"),
     (lambda: ScoreSpec.preset("dual", m=2), "takes no m"),
     (lambda: ScoreSpec("x<-y"), "direction"),
     (lambda: ScoreSpec(query_reduction="all", query_count=2), "query_count must be None"),
     (lambda: ScoreSpec(key_count=0), "key_count must be a positive integer"),
     (lambda: ScoreSpec(attention="sparse"), "attention")],
)
def test_bad_specs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shape_errors_are_clear():
    E, emask, F, fmask, codes = _data()
    poly, dual = ScoreSpec.preset("poly", m=M), ScoreSpec.preset("dual")
    with pytest.raises(ValueError, match="pass codes"):
        mention_reps(poly, E, emask)
    with pytest.raises(ValueError, match=r"codes must be \[3, 8\]"):
        mention_reps(poly, E, emask, codes[:2])
    with pytest.raises(ValueError, match="codes given"):
        mention_reps(dual, E, emask, codes)
    with pytest.raises(ValueError, match="mask must be"):
        mention_reps(dual, E, emask[:, :2])
    with pytest.raises(ValueError, match="at least one real token"):
        entity_reps(dual, F, torch.zeros_like(fmask))
    with pytest.raises(ValueError, match="the spec keeps"):
        score_all(dual, Reps(E, emask), entity_reps(dual, F, fmask))
    with pytest.raises(ValueError, match="disagree"):
        score_candidates(dual, mention_reps(dual, E, emask), Reps(torch.zeros(2, 4, D)))


def test_masks_with_all_real_positions_match_no_mask():
    E, _, F, _, _ = _data()
    spec = ScoreSpec.preset("som")
    ones_e, ones_f = torch.ones(E.shape[:2], dtype=torch.bool), torch.ones(F.shape[:2], dtype=torch.bool)
    a = score_all(spec, Reps(E, ones_e), Reps(F, ones_f))
    b = score_all(spec, Reps(E, None), Reps(F, None))
    ref = torch.einsum("btd,nsd->bnts", E, F).amax(-1).sum(-1)
    torch.testing.assert_close(a, ref)
    torch.testing.assert_close(b, ref)


def test_all_direction_attention_combinations_run():
    E, emask, F, fmask, codes = _data(seed=12)
    for direction, attention in itertools.product(("x->y", "y->x"), ("soft", "hard")):
        spec = ScoreSpec(direction, "all", None, "all", None, attention)
        ref = _pairwise(lambda *a: _general_form(spec, *a), E, emask, F, fmask, codes)
        torch.testing.assert_close(_fast_all(spec, E, emask, F, fmask, codes).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["hard", "soft"])
def test_arbitrary_mask_patterns(attention):
    """Masks need not be right-padded: any real positions, anywhere."""
    g = torch.Generator().manual_seed(13)
    E, F = torch.randn(3, 6, D, generator=g), torch.randn(5, 7, D, generator=g)
    emask, fmask = torch.rand(3, 6, generator=g) < 0.5, torch.rand(5, 7, generator=g) < 0.4
    emask[:, 3], fmask[:, 2] = True, True  # at least one real position per row
    spec = ScoreSpec("x->y", "all", None, "all", None, attention)
    ref = _pairwise(lambda *a: _general_form(spec, *a), E, emask, F, fmask, torch.zeros(M, D))
    for chunk in (None, 2):
        fast = score_all(spec, Reps(E, emask), Reps(F, fmask), chunk_size=chunk)
        torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_score_candidates_sums_half_precision_reps_in_fp32(half):
    """The training scores of bf16 reps (a DeepSpeed bf16 engine) are the fp32 products of those values,
    not products rounded to bf16 (at |s| ~ 700 bf16 values are 4 apart), and the gradient flows."""
    spec = ScoreSpec()
    g = torch.Generator().manual_seed(0)
    m = (torch.randn(3, 64, generator=g) * 3).to(half).requires_grad_()
    e = (torch.randn(3, 5, 64, generator=g) * 3).to(half)
    got = score_candidates(spec, Reps(m), Reps(e))
    want = torch.einsum("bd,bkd->bk", m.detach().double(), e.double()).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
    assert not torch.equal(got, got.to(half).float())  # finer than the half type's grid
    got.sum().backward()
    assert m.grad is not None and m.grad.dtype == half
