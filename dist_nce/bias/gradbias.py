"""Theorem 1's gradient bias, measured on a real model: the live bias monitor's pure core.

For a mention x whose score reads the mention representation q (``Reps``: what the mention
encoder hands the score function) and a set of entities Y,

    d/dq LSE_Y(q) = sum_{y in Y} softmax_Y(s(x, .))_y  d/dq s(x, y),      LSE_Y(q) = log sum_Y exp s(x, y).

The cross-entropy over the whole KB has gradient -ds(x, y*)/dq + d/dq LSE_KB(q); the NCE loss
over a candidate set C (gold + K-1 sampled negatives, eq. 7) has -ds(x, y*)/dq + d/dq LSE_C(q).
Theorem 1 (Zhang & Stratos 2021) writes the bias of the NCE gradient as
b = E_x[ sum_y (p(y|x) - gamma(y|x)) ds(x,y) ], with gamma(y|x) = E_C[softmax_C(y)]; on q:

    b(x) = d/dq LSE_KB(q) - E_C[ d/dq LSE_C(q) ]                                     (Theorem 1)

The first term is exact: one pass over the KB, a logsumexp and its gradient, shard by shard,
merged by :func:`merge` (a softmax over shards of their LSEs weights their gradients). The
second is estimated from R independent candidate sets drawn by the run's own sampler;
:func:`estimate` returns the bias vector with its Monte Carlo standard error.

For hard attention with mention columns as queries (dual, multi-m, SOM) both gradients take a
closed form: d s(x, y) / d q_i is the entity column that column i's max picked, so the forward
pass and one more GEMM on the chosen columns give it (:func:`_lse_grad_hard` over the KB,
:func:`_lse_grad_rows_hard` over the sets). The soft-attention presets (poly-m, genpoly-m) go
through autograd (``scoring.score_all`` / ``score_candidates``), which is also the closed forms'
reference (``autograd=True``). Autograd's backward through the [B, n, C, n'] similarity block cost
several forward passes on SOM and made the monitor's exact terms alone 7-8% of a random-negative
SOM run (docs/mini_paper.md; benchmarks/monitor.py measures the change).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from dist_nce.modeling.scoring import Reps, ScoreSpec, score_all, score_candidates


class LseGrad(NamedTuple):
    """lse: [*lead] float64 log-sum-exp of scores; grad: [*lead, *q_shape] float64, its gradient
    w.r.t. the mention representation (``q.vecs[b]`` has shape q_shape). An empty set has
    lse = -inf and grad = 0."""

    lse: Tensor
    grad: Tensor


def _wide(scores: Tensor) -> Tensor:
    """Half-precision scores are summed in float32; float32/64 stay as they are."""
    return scores.float() if scores.dtype in (torch.bfloat16, torch.float16) else scores


def _saveable(x: Tensor) -> Tensor:
    """A shard builds its index under inference_mode; autograd cannot save such tensors."""
    return x.clone() if x.is_inference() else x


def _leaf(q: Reps, dtype: torch.dtype) -> tuple[Tensor, Reps]:
    vecs = q.vecs.detach().to(dtype).requires_grad_(True)
    return vecs, Reps(vecs, q.mask)


def lse_grad_all(spec: ScoreSpec, q: Reps, entities: Reps, chunk_rows: int = 4096,
                 dtype: torch.dtype = torch.float32, dead: Tensor | None = None, autograd: bool = False
                 ) -> LseGrad:
    """LSE over ALL entity rows and its gradient, streamed over chunks of rows.

    q: mention Reps [B, ...]; entities: entity Reps [n, ...]; dead: optional int64 local rows left
    out (entities a KB delta removed). Memory is one chunk's scores and graph. Each chunk's
    (lse_j, grad_j) is folded into the running pair by the same rule as :func:`merge`, in float64.
    ``autograd``: take the gradient by autograd even where :func:`closed_form` applies (the reference).
    """
    batch = q.vecs.shape[0]
    out = LseGrad(torch.full((batch,), float("-inf"), dtype=torch.float64, device=q.vecs.device),
                  torch.zeros(q.vecs.shape, dtype=torch.float64, device=q.vecs.device))
    n = entities.vecs.shape[0]
    closed = closed_form(spec) and not autograd
    for a in range(0, n, chunk_rows):
        b = min(n, a + chunk_rows)
        gone = None if dead is None else dead[(dead >= a) & (dead < b)] - a
        if gone is not None and gone.numel() == b - a:
            continue  # every row of the chunk removed: it adds nothing
        block = Reps(entities.vecs[a:b], None if entities.mask is None else entities.mask[a:b])
        part = _lse_grad_hard(q, block, gone, dtype) if closed else _lse_grad_autograd(spec, q, block, gone, dtype)
        out = merge([out, part])
    return out


def closed_form(spec: ScoreSpec) -> bool:
    """Whether :func:`lse_grad_all` and :func:`lse_grad_rows` have the closed-form gradient for
    ``spec``: hard attention with mention columns as queries (dual, multi-m, SOM); poly-m and
    genpoly-m go through autograd."""
    return spec.attention == "hard" and spec.direction == "x->y"


def _lse_grad_autograd(spec: ScoreSpec, q: Reps, block: Reps, gone: Tensor | None, dtype: torch.dtype) -> LseGrad:
    """(lse [B], grad [B, *q_shape]) over the rows of ``block``, minus local rows ``gone``, by autograd."""
    leaf, reps = _leaf(q, dtype)
    block = Reps(_saveable(block.vecs.to(dtype)), None if block.mask is None else _saveable(block.mask))
    scores = _wide(score_all(spec, reps, block))
    if gone is not None and gone.numel():
        scores = scores.index_fill(1, gone.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=1)
    # Query b's score depends on q[b] only, so the gradient of the sum is per row.
    (grad,) = torch.autograd.grad(lse.sum(), leaf)
    return LseGrad(lse.detach().double(), grad.double())


def _lse_grad_hard(q: Reps, block: Reps, gone: Tensor | None, dtype: torch.dtype) -> LseGrad:
    """(lse [B], grad [B, *q_shape]) over the rows of ``block`` for s(x, y) = sum_i max_j q_i . f_j(y)
    (dual, multi-m and SOM; a padded column of either side takes no part).

    d s / d q_i = f_{j*}(y) with j* = argmax_j q_i . f_j(y) (ties share it evenly, as autograd's
    max does), so d LSE / d q_i = sum_y p(y) f_{j*}(y) with p the block's softmax: the forward
    GEMM, then one GEMM of the softmax weights placed on the chosen columns (a gather of the
    chosen columns, or max's indices, measured slower on CPU). As in ``score_all``, only real
    mention columns are multiplied, rows go through shortest first with each piece cut to its
    longest member, and a piece's [real columns, C, n'] similarities stay under 2^23 elements.
    A sum over rows does not care about their order, so nothing is put back.
    """
    vecs = q.vecs.to(dtype)
    cols = vecs.unsqueeze(1) if vecs.dim() == 2 else vecs  # [B, n, d]
    batch, n_q, dim = cols.shape
    real = None if q.mask is None or vecs.dim() == 2 else q.mask
    queries = cols.reshape(batch * n_q, dim) if real is None else cols[real]  # [R, d] real columns only
    owner = (torch.arange(batch, device=vecs.device).repeat_interleave(n_q) if real is None
             else real.nonzero()[:, 0])
    acc = torch.promote_types(dtype, torch.float32)
    rows = block.vecs.shape[0]
    evecs = block.vecs.unsqueeze(1) if block.vecs.dim() == 2 else block.vecs  # [N, n', d]
    emask = None if block.vecs.dim() == 2 or block.mask is None or bool(block.mask.all()) else block.mask
    order = None if emask is None else torch.argsort(emask.sum(-1), stable=True)
    alive = None
    if gone is not None and gone.numel():
        alive = torch.ones(rows, dtype=torch.bool, device=evecs.device)
        alive[gone.to(evecs.device)] = False
    step = max(1, (1 << 23) // max(queries.shape[0] * evecs.shape[1], 1))
    out = LseGrad(torch.full((batch,), float("-inf"), dtype=torch.float64, device=vecs.device),
                  torch.zeros((batch, n_q, dim), dtype=torch.float64, device=vecs.device))
    for a in range(0, rows, step):
        pick = slice(a, a + step) if order is None else order[a:a + step]
        ev = evecs[pick].to(dtype)
        em = None
        if emask is not None:
            em = emask[pick]
            width = int(em.sum(-1).max())  # rows come shortest first: cut the piece to its longest
            ev, em = ev[:, :width], em[:, :width]
        c, n_k, _ = ev.shape
        keys = ev.reshape(c * n_k, dim)
        sim = (queries @ keys.T).view(-1, c, n_k)  # [R, C, n']
        if em is not None:
            sim.masked_fill_(~em[None], float("-inf"))
        best = sim.amax(dim=-1)  # [R, C]
        scores = best.new_zeros((batch, c), dtype=acc).index_add_(0, owner, best.to(acc))  # [B, C]
        if alive is not None:
            scores = scores.masked_fill(~alive[pick][None], float("-inf"))
        lse = torch.logsumexp(scores, dim=1)
        finite = torch.isfinite(lse)
        p = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[:, None])  # [B, C]
        hit = sim == best.unsqueeze(-1)  # the chosen column(s) of each (real column, row)
        weight = hit.to(dtype).mul_(p.to(dtype)[owner][:, :, None])
        # Counted as bytes: a bool reduction over the last dim measured 10x slower on CPU.
        ties = hit.view(torch.uint8).sum(dim=-1, keepdim=True, dtype=torch.int16)
        if bool((ties > 1).any()):
            weight.div_(ties.to(dtype))
        chosen = weight.view(-1, c * n_k) @ keys  # [R, d]
        grad = torch.zeros((batch, n_q, dim), dtype=torch.float64, device=vecs.device)
        if real is None:
            grad = chosen.double().view(batch, n_q, dim)
        else:
            grad[real] = chosen.double()
        out = merge([out, LseGrad(lse.double(), grad)])
    return LseGrad(out.lse, out.grad.reshape(q.vecs.shape))


def lse_grad_rows(spec: ScoreSpec, q: Reps, entities: Reps, rows: Tensor, dtype: torch.dtype = torch.float32,
                  autograd: bool = False) -> LseGrad:
    """LSE over given entity rows and its gradient, for S sets per query.

    q: mention Reps [B, ...]; entities: entity Reps [n, ...]; rows: [B, S, K] int64 LOCAL row
    indices into ``entities``, -1 = not in this part (a row another shard owns). Returns
    lse [B, S] and grad [B, S, *q_shape]. The closed form where :func:`closed_form` says so
    (``autograd`` forces autograd, the reference).
    """
    if rows.dim() != 3 or rows.shape[0] != q.vecs.shape[0]:
        raise ValueError(f"lse_grad_rows: rows must be [B={q.vecs.shape[0]}, S, K], got {tuple(rows.shape)}")
    if closed_form(spec) and not autograd:
        return _lse_grad_rows_hard(q, entities, rows, dtype)
    batch, sets, k = rows.shape
    real = rows >= 0
    safe = rows.clamp_min(0)
    flat_q = Reps(q.vecs.repeat_interleave(sets, dim=0), None if q.mask is None else q.mask.repeat_interleave(sets, 0))
    leaf, reps = _leaf(flat_q, dtype)
    picked = entities.vecs[safe.reshape(-1)].reshape(batch * sets, k, *entities.vecs.shape[1:])
    ents = Reps(_saveable(picked.to(dtype)),
                None if entities.mask is None else
                entities.mask[safe.reshape(-1)].reshape(batch * sets, k, *entities.mask.shape[1:]))
    scores = _wide(score_candidates(spec, reps, ents)).masked_fill(~real.reshape(batch * sets, k), float("-inf"))
    lse = torch.logsumexp(scores, dim=1)
    has = real.reshape(batch * sets, k).any(dim=1)
    # logsumexp of all -inf is -inf and its gradient NaN: such sets contribute nothing.
    safe_lse = torch.where(has, lse, torch.zeros_like(lse))
    (grad,) = torch.autograd.grad(safe_lse.sum(), leaf)
    grad = torch.where(has.view(-1, *[1] * (grad.dim() - 1)), grad, torch.zeros_like(grad))
    shape = (batch, sets, *q.vecs.shape[1:])
    return LseGrad(lse.detach().double().reshape(batch, sets), grad.double().reshape(shape))


def _lse_grad_rows_hard(q: Reps, entities: Reps, rows: Tensor, dtype: torch.dtype) -> LseGrad:
    """:func:`lse_grad_rows` in closed form for s(x, y) = sum_i max_j q_i . f_j(y) (dual, multi-m,
    SOM), as :func:`_lse_grad_hard` does over the whole KB: one batched GEMM per mention against
    its S x K candidates' columns, then one more on the chosen columns, weighted set by set."""
    batch, sets, k = rows.shape
    vecs = q.vecs.to(dtype)
    cols = vecs.unsqueeze(1) if vecs.dim() == 2 else vecs  # [B, n, d]
    n_q, dim = cols.shape[1:]
    qmask = None if q.mask is None or vecs.dim() == 2 else q.mask
    if qmask is not None:
        cols = cols.masked_fill(~qmask.unsqueeze(-1), 0)
    acc = torch.promote_types(dtype, torch.float32)
    real = rows >= 0
    flat = rows.clamp_min(0).reshape(-1)
    ents = entities.vecs[flat].to(dtype)
    ents = ents.unsqueeze(1) if ents.dim() == 2 else ents  # [B*S*K, n', d]
    n_k = ents.shape[1]
    keys = ents.view(batch, sets * k * n_k, dim)
    sim = torch.bmm(cols, keys.transpose(1, 2)).view(batch, n_q, sets * k, n_k)
    if entities.mask is not None and entities.vecs.dim() == 3:
        sim.masked_fill_(~entities.mask[flat].view(batch, 1, sets * k, n_k), float("-inf"))
    top = sim.amax(dim=-1)  # [B, n, S*K]
    best = top if qmask is None else top.masked_fill(~qmask[:, :, None], 0)
    scores = best.sum(dim=1, dtype=acc).view(batch, sets, k).masked_fill(~real, float("-inf"))
    lse = torch.logsumexp(scores, dim=2)  # [B, S]; -inf for a set with no row here
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])  # [B, S, K]; 0 off the set
    hit = sim == top.unsqueeze(-1)  # the chosen column(s) of each (column, candidate)
    weight = hit.to(dtype).mul_(p.to(dtype).view(batch, 1, sets * k, 1))
    ties = hit.view(torch.uint8).sum(dim=-1, keepdim=True, dtype=torch.int16)
    if bool((ties > 1).any()):
        weight.div_(ties.to(dtype))
    # grad[b, s, i] = sum over the set's K candidates and their columns of weight * column
    w = weight.view(batch, n_q, sets, k * n_k).permute(0, 2, 1, 3).reshape(batch * sets, n_q, k * n_k)
    grad = torch.bmm(w, ents.view(batch * sets, k * n_k, dim)).view(batch, sets, n_q, dim).double()
    if qmask is not None:
        grad = grad.masked_fill(~qmask[:, None, :, None], 0)
    return LseGrad(lse.double(), grad.reshape(batch, sets, *q.vecs.shape[1:]))


def merge(parts: Sequence[LseGrad]) -> LseGrad:
    """Combine LSEs and gradients over DISJOINT row sets (shards, chunks).

    LSE = log sum_s exp(lse_s); d LSE = sum_s exp(lse_s - LSE) d lse_s. Parts with lse = -inf
    (no rows) get weight 0.
    """
    lse = torch.logsumexp(torch.stack([p.lse for p in parts]), dim=0)
    grad = torch.zeros_like(parts[0].grad)
    finite = torch.isfinite(lse)
    for p in parts:
        w = torch.where(finite, torch.exp(p.lse - torch.where(finite, lse, torch.zeros_like(lse))),
                        torch.zeros_like(lse))
        grad = grad + w.view(*w.shape, *[1] * (grad.dim() - w.dim())) * p.grad
    return LseGrad(lse, grad)


class BiasEstimate(NamedTuple):
    """Per mention: bias [B, *q_shape] (Theorem 1, on q), norm [B] = ||bias||, se [B] its Monte
    Carlo standard error (delta method along the bias direction), noise [B] =
    sqrt(trace Cov / R), the norm a zero bias would show from sampling noise alone."""

    bias: Tensor
    norm: Tensor
    se: Tensor
    noise: Tensor


def estimate(full: LseGrad, sets: LseGrad) -> BiasEstimate:
    """b = d LSE_KB - mean_r d LSE_{C_r}; full.grad [B, *q], sets.grad [B, R, *q] (R >= 2)."""
    r = sets.grad.shape[1]
    if r < 2:
        raise ValueError(f"estimate: need at least 2 candidate sets per mention for a standard error, got {r}")
    g = sets.grad.flatten(2)  # [B, R, D]
    bias = full.grad.flatten(1) - g.mean(dim=1)
    norm = bias.norm(dim=1)
    unit = bias / norm.clamp_min(1e-300)[:, None]
    proj = (g * unit[:, None, :]).sum(dim=2)  # [B, R]: each draw along the bias direction
    se = proj.std(dim=1, unbiased=True) / r ** 0.5
    noise = (g.var(dim=1, unbiased=True).sum(dim=1) / r).sqrt()
    return BiasEstimate(bias.reshape(full.grad.shape), norm, se, noise)


def summary(est: BiasEstimate) -> dict[str, float]:
    """Scalars to log: the mean over probe mentions of ||b|| with its standard error (draws are
    independent across mentions), the sampling-noise floor, and ||mean b|| (Theorem 1's E_x)."""
    p = est.norm.shape[0]
    return {"bias/norm": float(est.norm.mean()), "bias/norm_se": float(est.se.pow(2).sum().sqrt() / p),
            "bias/noise_floor": float(est.noise.mean()),
            "bias/mean_vector_norm": float(est.bias.flatten(1).mean(0).norm())}
