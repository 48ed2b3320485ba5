"""Batch assembly from a store: gold in column 0, token gathers, padding trimmed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.sampling.negatives import Negatives
from dist_nce.train.batches import assemble_batch, candidate_rows, trimmed


class ArrayStore:
    """The two EntityStore gathers over plain arrays."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray):
        self.tokens, self.lens = tokens, lengths

    def token_ids(self, rows):
        return self.tokens[np.asarray(rows)]

    def lengths(self, rows):
        return self.lens[np.asarray(rows)]


def make_store(n=20, width=10, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 7, n).astype(np.int32)  # never longer than 6 of 10 columns
    tokens = np.zeros((n, width), np.int32)
    for r, length in enumerate(lengths):
        tokens[r, :length] = rng.integers(100, 200, length)
    return ArrayStore(tokens, lengths)


def test_trimmed_keeps_exactly_the_real_columns():
    tokens = np.array([[5, 6, 0, 0, 0], [7, 8, 9, 0, 0]], np.int32)
    ids, mask = trimmed(tokens, np.array([2, 3]))
    assert ids.tolist() == [[5, 6, 0], [7, 8, 9]] and ids.dtype == torch.int64
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    ids, mask = trimmed(np.zeros((2, 4), np.int32), np.array([0, 0]))
    assert ids.shape == (2, 1) and not mask.any()
    with pytest.raises(ValueError, match="exceeds the token width"):
        trimmed(tokens, np.array([2, 6]))


def test_candidate_rows_checks_the_sampler_contract():
    gold = torch.tensor([3, 4])
    assert candidate_rows(gold, torch.tensor([[1, 2], [5, 6]])).tolist() == [[3, 1, 2], [4, 5, 6]]
    with pytest.raises(ValueError, match="row 1 has the gold among its negatives"):
        candidate_rows(gold, torch.tensor([[1, 2], [4, 6]]))
    with pytest.raises(ValueError, match="row 0 has a repeated negative"):
        candidate_rows(gold, torch.tensor([[1, 1], [5, 6]]))
    with pytest.raises(ValueError, match="-1"):
        candidate_rows(gold, torch.tensor([[1, -1], [5, 6]]))
    with pytest.raises(ValueError, match="no gold entity"):
        candidate_rows(torch.tensor([-1, 4]), torch.tensor([[1, 2], [5, 6]]))


def test_assemble_batch_matches_a_per_row_reference():
    store = make_store()
    mentions = make_store(n=4, width=8, seed=1)
    gold = torch.tensor([0, 5, 9, 19])
    neg_ids = torch.tensor([[1, 2, 3], [6, 7, 8], [10, 11, 0], [18, 17, 16]])
    negs = Negatives(neg_ids, torch.linspace(-3, -1, 12).view(4, 3), torch.tensor([[1, 1, 0]] * 4).bool())
    b = assemble_batch(mentions.tokens, mentions.lens, store, gold, negs)
    assert b.candidates[:, 0].tolist() == gold.tolist() and b.candidates[:, 1:].tolist() == neg_ids.tolist()
    width = int(store.lens[b.candidates.numpy()].max())
    assert b.cand_ids.shape == (4, 4, width) and b.mention_ids.shape == (4, int(mentions.lens.max()))
    for i in range(4):
        for j in range(4):
            row = int(b.candidates[i, j])
            length = int(store.lens[row])
            assert b.cand_ids[i, j, :length].tolist() == store.tokens[row, :length].tolist()
            assert b.cand_mask[i, j].tolist() == [c < length for c in range(width)]
        assert b.mention_ids[i, :mentions.lens[i]].tolist() == mentions.tokens[i, :mentions.lens[i]].tolist()
    assert torch.equal(b.log_q, negs.log_q) and torch.equal(b.hard, negs.hard)
