"""Training batch assembly from the prepared store: mentions, gold + K-1 negatives, token ids.

The loss (``losses.nce_loss``) wants column 0 of the score matrix to be the gold, so the
candidates of mention ``i`` are ``[gold_i, neg_i1, ..., neg_i(K-1)]``. Their token ids are
gathered by row id from the memory-mapped store (only the pages touched are read), then
cut to the longest real row of the batch: columns that are padding in every row carry
no information (attention masks them) and would cost compute.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from dist_nce.sampling.negatives import Negatives


class TokenSource(Protocol):
    """What :class:`kb.store.EntityStore` offers (and a test double can)."""

    def token_ids(self, rows: np.ndarray) -> np.ndarray: ...  # [*S] -> int32 [*S, L]

    def lengths(self, rows: np.ndarray) -> np.ndarray: ...  # [*S] -> int32 [*S]


class Batch(NamedTuple):
    """One worker's micro batch of B mentions with K candidates each.

    mention_ids, mention_mask: [B, L] int64 / bool (L = longest mention of the batch).
    cand_ids, cand_mask:       [B, K, L'] int64 / bool (L' = longest candidate of the batch).
    candidates:                [B, K] int64 entity rows; column 0 is the gold.
    log_q:                     [B, K-1] float32 log nu(y_k | x, gold) of each negative.
    hard:                      [B, K-1] bool, True for hard negatives.
    """

    mention_ids: Tensor
    mention_mask: Tensor
    cand_ids: Tensor
    cand_mask: Tensor
    candidates: Tensor
    log_q: Tensor
    hard: Tensor

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in self))


def trimmed(tokens: np.ndarray, lengths: np.ndarray) -> tuple[Tensor, Tensor]:
    """tokens [..., L] int32, lengths [...] -> (ids [..., W] int64, mask [..., W] bool), W = max length.

    Real tokens are left-aligned (BLINK convention), so position j of a row is real iff
    j < its length; W >= 1 keeps the [CLS] column even for an all-empty batch.
    """
    lengths = np.asarray(lengths)
    width = max(int(lengths.max(initial=0)), 1)
    if width > tokens.shape[-1]:
        raise ValueError(f"a length {width} exceeds the token width {tokens.shape[-1]}")
    ids = torch.from_numpy(np.ascontiguousarray(tokens[..., :width])).long()
    mask = torch.arange(width) < torch.from_numpy(lengths.astype(np.int64))[..., None]
    return ids, mask


def candidate_rows(gold: Tensor, negatives: Tensor) -> Tensor:
    """gold [B], negatives [B, K-1] -> [B, K] with the gold in column 0.

    Checks the sampler's contract: no negative is the gold, none is -1, no duplicates in a
    row (a duplicate would count one entity twice in the softmax denominator).
    """
    if gold.dim() != 1 or negatives.dim() != 2 or negatives.shape[0] != gold.shape[0]:
        raise ValueError(f"expected gold [B] and negatives [B, K-1], got {list(gold.shape)} and "
                         f"{list(negatives.shape)}")
    cand = torch.cat([gold[:, None], negatives], dim=1).long()
    if bool((gold < 0).any()):
        raise ValueError("a training mention has no gold entity (gold_row -1); it should have been excluded")
    if bool((negatives < 0).any()):
        raise ValueError("a negative id is -1: the service returned fewer than K-1 negatives")
    srt = cand.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
    if bool(dup.any()):
        row = int(dup.nonzero()[0])
        which = "the gold among its negatives" if bool((negatives[row] == gold[row]).any()) else "a repeated negative"
        raise ValueError(f"batch row {row} has {which}: candidates {cand[row].tolist()}")
    return cand


def assemble_batch(mention_tokens: np.ndarray, mention_lengths: np.ndarray, store: TokenSource,
                   gold: Tensor, negatives: Negatives) -> Batch:
    """The tensors of one training step.

    Args:
        mention_tokens: [B, L] int32 token ids of the batch's mentions (MentionTable.token_ids).
        mention_lengths: [B] real lengths.
        store: the entity store (global row ids).
        gold: [B] int64 gold rows.
        negatives: K-1 negatives per mention (``Negatives.ids`` [B, K-1]).
    """
    candidates = candidate_rows(gold, negatives.ids)
    rows = candidates.numpy()
    m_ids, m_mask = trimmed(mention_tokens, mention_lengths)
    c_ids, c_mask = trimmed(store.token_ids(rows), store.lengths(rows))
    return Batch(m_ids, m_mask, c_ids, c_mask, candidates, negatives.log_q.float(), negatives.hard)
