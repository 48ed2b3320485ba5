"""Negative samplers for hard-negative NCE: random, hard (exact Gumbel-top-k), mixed-p.

Zhang & Stratos (NAACL 2021), section 3: the loss for a mention x with gold y1 takes
K-1 negatives y2..yK drawn from a negative distribution nu(. | x, y1). Each sampler
here returns the negatives AND log nu(y_k | x, y1) for each of them, which the
score-adjusted loss (eq. 6, ``losses.adjusted_nce_loss``) subtracts as
log((K-1) nu(y_k | x, y1)).

**Which nu.** ``log_q`` is always the PER-DRAW proposal, not the probability that a
without-replacement sample contains y (the paper's convention):

* random: nu(y) = 1 / |Y \\ ({y1} ∪ excluded)|, uniform (``log_q = -log(N - 1)`` without
  extra exclusions);
* hard: nu(y) = exp s(x,y) / sum_{y' != y1} exp s(x,y'), the softmax over the whole KB
  minus the gold; ``log_q = s(x,y) - log_z`` with ``log_z`` from the (merged) search;
* mixed-p with a = n_hard/(K-1): nu(y) = a * hard(y) + (1-a) / (N-1), the mixture; see
  :func:`mixed_negatives` for the stratified alternative when the proposal scores of the
  random draws are not available.

**Hard negatives are exact.** K-1 entities without replacement, proportional to
exp(s), is the top K-1 of s(x,y) + G(y) with iid standard Gumbel G (the Gumbel-top-k
trick; successive sampling / Plackett-Luce order). The noise is counter-based:
G(y) = F(seed, query_key, y), a pure function of three integers (splitmix64 hashing),
so a shard owning rows [a, b) draws exactly the noise the flat search would. Given
identical scores (``index.search`` computes them on a global block grid so that they
are), the merged sample equals the flat sample bit for bit on the same device,
whatever the shard count.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from dist_nce.sampling.block_gumbel import gumbel_topk_block
from dist_nce.sampling.noise import gumbel_noise
from dist_nce.sampling.topk import ShardResult, as_gold, first_occurrence, isin_rows, mask_gold, result_from_keys

class Negatives(NamedTuple):
    """K-1 negatives per mention.

    ids:   [B, K-1] int64 global entity rows (never the gold, no duplicates in a row).
    log_q: [B, K-1] float32 log nu(y | x, gold), the per-draw proposal (module docstring).
    hard:  [B, K-1] bool, True where the negative came from the hard sampler.
    """

    ids: Tensor
    log_q: Tensor
    hard: Tensor


def num_hard(p: float, num_negatives: int) -> int:
    """Hard negatives in a mixed-p sample: round-half-up of p/100 * (K-1).

    p=50, K=64: 31.5 -> 32 hard, 31 random (+ the gold = 64), as in the paper.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"mixed-p: p must be in [0, 100], got {p}")
    # Fraction keeps 0.5 * 63 = 31.5 exact, so the half rounds up reliably.
    return math.floor(Fraction(p).limit_denominator(10**6) * num_negatives / 100 + Fraction(1, 2))


def _generator(seed_or_gen: int | torch.Generator, device: torch.device) -> torch.Generator:
    if isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    g = torch.Generator(device=device)
    g.manual_seed(int(seed_or_gen))
    return g


def _count_banned(banned: Tensor, num_entities: int) -> Tensor:
    """[B] number of distinct ids of ``banned`` [B, e] inside [0, N)."""
    valid = (banned >= 0) & (banned < num_entities)
    return (first_occurrence(banned) & valid).sum(dim=1)


def _uniform_distinct(num_entities: int, k: int, banned: Tensor, gen: torch.Generator) -> Tensor:
    """[B, k] uniform k-subsets of [0, N) minus banned[b], in uniformly random order."""
    batch, device = banned.shape[0], banned.device
    out = torch.empty((batch, k), dtype=torch.int64, device=device)
    if k == 0:
        return out
    if num_entities <= 8 * (k + banned.shape[1]) + 64:
        # Small label space: exact via random keys over all entities.
        keys = torch.rand((batch, num_entities), generator=gen, device=device)
        b, col = (banned >= 0) & (banned < num_entities), banned.clamp(0, num_entities - 1)
        keys[torch.arange(batch, device=device)[:, None].expand_as(col)[b], col[b]] = 2.0
        return torch.topk(keys, k, dim=1, largest=False).indices
    # Large KB: draw with replacement, keep first occurrences that are not banned, reject a
    # row's whole draw if it has fewer than k. The accepted set is a uniform k-subset because
    # the rejection event depends only on how many distinct values appeared (exchangeability).
    todo = torch.arange(batch, device=device)
    width = 2 * (k + banned.shape[1]) + 16
    while todo.numel():
        cand = torch.randint(0, num_entities, (todo.numel(), width), generator=gen, device=device)
        keep = first_occurrence(cand) & ~isin_rows(cand, banned[todo])
        ok = keep.sum(dim=1) >= k
        pos = torch.where(keep, torch.arange(width, device=device), width)
        first_k = torch.topk(pos, k, dim=1, largest=False).indices.sort(dim=1).values
        out[todo[ok]] = cand[ok].gather(1, first_k[ok])
        todo, width = todo[~ok], width * 2
    return out


def sample_random(num_entities: int, num_negatives: int, gold: Tensor, generator: int | torch.Generator,
                  exclude: Tensor | None = None) -> Negatives:
    """Uniform negatives without duplicates, never the gold nor ``exclude``.

    Args:
        num_entities: N, the KB size.
        num_negatives: K-1 (or the random part of a mixed sample).
        gold: [B] or [B, e] int64 gold rows (-1 = none).
        generator: a seed or a torch.Generator (on gold's device); same seed, same negatives.
        exclude: optional [B, E] int64 rows to avoid too (e.g. hard negatives already drawn).
    Returns:
        Negatives with log_q = -log(N - #distinct excluded rows incl. the gold).
    """
    gold = as_gold(gold)
    if exclude is not None and (exclude.dtype != torch.int64 or exclude.dim() != 2 or
                                exclude.shape[0] != gold.shape[0]):
        raise ValueError(f"sample_random: exclude must be int64 [B={gold.shape[0]}, E], got {exclude.dtype} "
                         f"{list(exclude.shape)}")
    banned = gold if exclude is None else torch.cat([gold, exclude.to(gold.device)], dim=1)
    eligible = num_entities - _count_banned(banned, num_entities)
    if int(eligible.min()) < num_negatives:
        row = int(eligible.argmin())
        raise ValueError(f"sample_random: row {row} has only {int(eligible[row])} eligible entities "
                         f"for {num_negatives} negatives (N={num_entities})")
    ids = _uniform_distinct(num_entities, num_negatives, banned, _generator(generator, gold.device))
    log_q = (-torch.log(eligible.to(torch.float64)))[:, None].expand_as(ids).float()
    return Negatives(ids, log_q.contiguous(), torch.zeros_like(ids, dtype=torch.bool))


def hard_negatives(result: ShardResult, num_negatives: int) -> Negatives:
    """Hard negatives from a merged exact Gumbel-top-k ``result`` (gold excluded by the search).

    log_q = s(x, y) - log_z: the softmax over the rows the search drew from (the whole KB
    minus the gold for exact search; the retrieved candidates for candidate mode, whose
    missing mass ``result.truncation()`` reports).
    """
    if result.log_z is None:
        raise ValueError("hard_negatives: the search result has no log_z (use a Gumbel search)")
    if result.ids.shape[1] < num_negatives:
        raise ValueError(f"hard_negatives: result has {result.ids.shape[1]} columns, need {num_negatives}")
    ids = result.ids[:, :num_negatives]
    if bool((ids < 0).any()):
        row = int((ids < 0).any(dim=1).nonzero()[0])
        raise ValueError(f"hard_negatives: row {row} has fewer than {num_negatives} eligible entities")
    log_q = result.scores[:, :num_negatives].double() - result.log_z[:, None].to(torch.float64)
    return Negatives(ids, log_q.float(), torch.ones_like(ids, dtype=torch.bool))


def sample_hard(scores: Tensor, num_negatives: int, gold: Tensor, seed: int, query_keys: Tensor,
                sampler: str = "dense", block_rows: int = 128) -> Negatives:
    """Flat reference: exact hard negatives from the full score matrix ``scores`` [B, N].

    sampler: "dense" (one Gumbel per row, :func:`gumbel_topk_dense`) or "block" (top-down over
    blocks of ``block_rows`` rows, ``sampling.block_gumbel``): the same law, different draws.
    Same noise and tie rule as the sharded search of the same sampler, so it returns the same
    sample.
    """
    if sampler == "dense":
        result = gumbel_topk_dense(scores, num_negatives, gold, seed, query_keys)
    elif sampler == "block":
        result = gumbel_topk_block(scores, num_negatives, gold, seed, query_keys, block_rows)
    else:
        raise ValueError(f"sample_hard: sampler must be 'dense' or 'block', got {sampler!r}")
    return hard_negatives(result, num_negatives)


def gumbel_topk_dense(scores: Tensor, k: int, gold: Tensor | None, seed: int | None, query_keys: Tensor | None,
                      row_start: int = 0, version: int = 0) -> ShardResult:
    """Top k of scores [B, n] for global rows [row_start, row_start+n), gold excluded.

    With ``seed`` the keys are s + Gumbel noise in float64 (an exact sample of k without
    replacement proportional to exp(s)); without, plain top-k of the scores. ``log_z`` is
    the gold-excluded logsumexp (float64 [B]).
    """
    batch, n = scores.shape
    rows = torch.arange(row_start, row_start + n, device=scores.device)
    masked = mask_gold(scores, gold, row_start)
    log_z = torch.logsumexp(masked, dim=1).double()
    keys = masked if seed is None else masked.double().add_(gumbel_noise(seed, query_keys, rows))
    return result_from_keys(keys, scores, rows.expand(batch, n), k, log_z=log_z, version=version)


def random_pool(num_entities: int, num_negatives: int, gold: Tensor, generator: int | torch.Generator) -> Tensor:
    """[B, K-1] distinct non-gold rows in uniformly random order: where the random part of a
    mixed-p sample comes from (:func:`mixed_from_pool`).

    It is drawn before the hard part is known, so a sharded search can score these rows in
    the same call, from the same index version, as it samples the hard ones.
    """
    return sample_random(num_entities, num_negatives, gold, generator).ids


def mixed_from_pool(hard: ShardResult, num_entities: int, num_negatives: int, p: float, gold: Tensor,
                    pool: Tensor, pool_scores: Tensor | None = None) -> Negatives:
    """Mixed-p: :func:`num_hard` hard negatives from ``hard`` plus the first K-1 - n_hard rows
    of ``pool`` (:func:`random_pool`) that are not among them.

    pool: [B, K-1] int64; pool_scores: [B, K-1] exact proposal scores s(x, y) of the pool's
    rows, or None. Why the random part is uniform: the pool is a uniformly ordered sample
    of the non-gold rows, drawn independently of the hard part, and dropping the (at most
    n_hard) rows it shares with the hard part leaves a uniformly ordered sample of the
    rows that are neither gold nor hard, of length >= K-1 - n_hard.

    log_q is the per-draw mixture nu(y) = a * exp(s(y) - log_z) + (1 - a) / (N - 1),
    a = n_hard / (K-1), when ``pool_scores`` is given; otherwise the STRATIFIED proposal: each
    negative gets the log-probability of the component that drew it. Both make
    sum_k exp(s_k) / ((K-1) nu(y_k)) an unbiased estimate of the partition sum over the KB
    (up to the with/without replacement difference the paper also ignores).
    """
    if pool.shape != (gold.shape[0], num_negatives):
        raise ValueError(f"mixed_from_pool: pool must be [B={gold.shape[0]}, K-1={num_negatives}], "
                         f"got {list(pool.shape)}")
    k_hard = num_hard(p, num_negatives)
    k_rand = num_negatives - k_hard
    hard_part = hard_negatives(hard, k_hard) if k_hard else None
    hard_ids = hard_part.ids if hard_part is not None else pool[:, :0]
    width = pool.shape[1]
    pos = torch.where(~isin_rows(pool, hard_ids), torch.arange(width, device=pool.device), width)
    take = torch.topk(pos, k_rand, dim=1, largest=False).values  # first k_rand kept positions, in order
    rand_ids = pool.gather(1, take)
    rand_hard = torch.zeros_like(rand_ids, dtype=torch.bool)
    if hard_part is None:
        eligible = num_entities - _count_banned(as_gold(gold), num_entities)
        log_q = (-torch.log(eligible.to(torch.float64)))[:, None].expand_as(rand_ids).float()
        return Negatives(rand_ids, log_q.contiguous(), rand_hard)
    ids = torch.cat([hard_part.ids, rand_ids], dim=1)
    is_hard = torch.cat([hard_part.hard, rand_hard], dim=1)
    if pool_scores is None:
        uniform = torch.full(rand_ids.shape, -math.log(num_entities - 1), dtype=torch.float32, device=ids.device)
        return Negatives(ids, torch.cat([hard_part.log_q, uniform], dim=1), is_hard)
    proposal_scores = torch.cat([hard.scores[:, :k_hard].double(), pool_scores.gather(1, take).double()], dim=1)
    log_soft = proposal_scores - hard.log_z[:, None].double()
    a = k_hard / num_negatives
    log_uniform = math.log1p(-a) - math.log(num_entities - 1) if a < 1 else float("-inf")
    log_q = torch.logaddexp(log_soft + math.log(a), torch.full_like(log_soft, log_uniform))
    return Negatives(ids, log_q.float(), is_hard)


def mixed_negatives(hard: ShardResult, num_entities: int, num_negatives: int, p: float, gold: Tensor,
                    generator: int | torch.Generator,
                    random_scores_fn: Callable[[Tensor], Tensor] | None = None) -> Negatives:
    """Mixed-p in one process: :func:`mixed_from_pool` over ``random_pool(..., generator)``.

    ``random_scores_fn(ids [B, K-1]) -> [B, K-1]`` gives the proposal scores of the pool's
    rows (e.g. ``scores.gather(1, ids)``); without it log_q is stratified.
    """
    pool = random_pool(num_entities, num_negatives, gold, generator)
    scores = random_scores_fn(pool) if random_scores_fn is not None else None
    return mixed_from_pool(hard, num_entities, num_negatives, p, gold, pool, scores)