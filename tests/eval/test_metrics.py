"""Linking metrics against hand-computed examples and a brute-force loop reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dist_nce.eval import metrics as M

# Three worlds of unequal size; every number below is worked out by hand in the comments.
#   row  world  ranked (best first)   gold
RANKED = np.array(
    [
        [10, 11, 12],  # 0  a   gold 10 at rank 1
        [20, 21, -1],  # 1  a   gold 21 at rank 2 (one padding slot)
        [30, 31, 32],  # 2  a   gold 99 absent
        [40, -1, -1],  # 3  a   gold -1 (not in KB): always a miss
        [50, 51, 52],  # 4  b   gold 52 at rank 3
        [60, 61, 62],  # 5  c   gold 60 at rank 1
    ]
)
GOLD = np.array([10, 21, 99, -1, 52, 60])
WORLDS = np.array(["a", "a", "a", "a", "b", "c"])


def test_recall_micro_and_macro_with_unequal_worlds():
    # hits@1 = [1,0,0,0,0,1] -> micro 2/6; per world a 1/4, b 0, c 1 -> macro (1/4+0+1)/3
    assert M.recall_at_k(RANKED, GOLD, 1) == pytest.approx(2 / 6)
    assert M.recall_at_k(RANKED, GOLD, 1, WORLDS, "macro") == pytest.approx((0.25 + 0 + 1) / 3)
    # hits@2 = [1,1,0,0,0,1]: a 2/4, b 0, c 1
    assert M.recall_at_k(RANKED, GOLD, 2) == pytest.approx(3 / 6)
    assert M.recall_at_k(RANKED, GOLD, 2, WORLDS, "macro") == pytest.approx((0.5 + 0 + 1) / 3)


def test_k_larger_than_candidate_list_uses_all_columns():
    # K=3; k=3 and k=100 agree: hits = [1,1,0,0,1,1]
    assert M.recall_at_k(RANKED, GOLD, 3) == pytest.approx(4 / 6)
    assert M.recall_at_k(RANKED, GOLD, 100) == pytest.approx(4 / 6)
    assert M.recall_at_k(RANKED, GOLD, 100, WORLDS, "macro") == pytest.approx((0.5 + 1 + 1) / 3)


def test_gold_not_in_kb_is_a_miss_even_against_padding():
    # gold -1 must not match the -1 padding in row 3 (or anywhere).
    hits = M.hits_at_k(np.array([[-1, -1], [7, -1]]), np.array([-1, -1]), 2)
    assert hits.tolist() == [False, False]
    assert M.accuracy(np.array([-1, 3]), np.array([-1, 3])) == pytest.approx(0.5)


def test_accuracy_normalized_and_unnormalized():
    # reranker picks among the retriever's candidates:
    pred = np.array([10, 20, 30, 40, 52, 61])
    # correct = [1,0,0,0,1,0]
    assert M.unnormalized_accuracy(pred, GOLD) == pytest.approx(2 / 6)
    assert M.accuracy(pred, GOLD, WORLDS, "macro") == pytest.approx((0.25 + 1 + 0) / 3)
    # gold in top-3: rows 0,1,4,5 -> correct among them 0,4 -> 2/4
    assert M.normalized_accuracy(pred, RANKED, GOLD, 3) == pytest.approx(2 / 4)
    # per world: a rows 0,1 -> 1/2; b row 4 -> 1; c row 5 -> 0
    assert M.normalized_accuracy(pred, RANKED, GOLD, 3, WORLDS, "macro") == pytest.approx((0.5 + 1 + 0) / 3)
    # U.Acc = N.Acc * recall@k (micro) when the prediction is among the candidates
    assert M.unnormalized_accuracy(pred, GOLD) == pytest.approx(
        M.normalized_accuracy(pred, RANKED, GOLD, 3) * M.recall_at_k(RANKED, GOLD, 3)
    )


def test_macro_skips_worlds_with_empty_denominator():
    # at k=1 world b (gold at rank 3) has no mention in the normalized denominator.
    pred = np.array([10, 20, 30, 40, 52, 61])
    pw = M.per_world(M.correct(pred, GOLD), WORLDS, M.hits_at_k(RANKED, GOLD, 1))
    assert pw["b"].count == 0 and math.isnan(pw["b"].value)
    # a: row 0 correct -> 1; c: row 5 wrong -> 0; b skipped
    assert M.normalized_accuracy(pred, RANKED, GOLD, 1, WORLDS, "macro") == pytest.approx(0.5)
    assert math.isnan(M.normalized_accuracy(pred, RANKED[:, :0], GOLD, 1))


def test_rank_by_score_breaks_ties_by_smaller_id_and_puts_padding_last():
    ids = np.array([[7, 3, -1, 5, 9], [2, 1, 4, 3, -1]])
    scores = np.array([[1.0, 2.0, 99.0, 2.0, 1.0], [0.5, 0.5, 0.5, 0.5, 7.0]])
    ranked = M.rank_by_score(ids, scores)
    assert ranked.tolist() == [[3, 5, 7, 9, -1], [1, 2, 3, 4, -1]]
    # input order does not matter
    perm = np.array([4, 2, 0, 3, 1])
    assert (M.rank_by_score(ids[:, perm], scores[:, perm]) == ranked).all()
    # ties decide recall@1: gold 5 ties with 3 but loses on id
    assert M.recall_at_k(ranked, np.array([5, 1]), 1) == pytest.approx(0.5)


def test_rank_by_score_rejects_nan_and_shape_mismatch():
    with pytest.raises(ValueError, match="NaN score for a real candidate in row 1"):
        M.rank_by_score(np.array([[1, 2], [3, 4]]), np.array([[0.0, 1.0], [np.nan, 1.0]]))
    # NaN under padding is ignored
    assert M.rank_by_score(np.array([[1, -1]]), np.array([[0.0, np.nan]])).tolist() == [[1, -1]]
    with pytest.raises(ValueError, match=r"scores: expected shape \(1, 2\)"):
        M.rank_by_score(np.array([[1, 2]]), np.array([[0.0, 1.0, 2.0]]))


def test_torch_inputs_match_numpy():
    t = M.recall_at_k(torch.from_numpy(RANKED), torch.from_numpy(GOLD), 2, WORLDS, "macro")
    assert t == M.recall_at_k(RANKED, GOLD, 2, WORLDS, "macro")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"ranked: expected shape \[N, K\]"):
        M.hits_at_k(np.array([1, 2]), np.array([1, 2]), 1)
    with pytest.raises(ValueError, match="gold: expected 6 rows"):
        M.hits_at_k(RANKED, GOLD[:5], 1)
    with pytest.raises(ValueError, match="k: expected a positive integer"):
        M.hits_at_k(RANKED, GOLD, 0)
    with pytest.raises(ValueError, match="integer entity ids"):
        M.hits_at_k(RANKED.astype(float), GOLD, 1)
    with pytest.raises(ValueError, match="no mentions"):
        M.hits_at_k(RANKED[:0], GOLD[:0], 1)
    with pytest.raises(ValueError, match="macro average needs worlds"):
        M.recall_at_k(RANKED, GOLD, 1, how="macro")
    with pytest.raises(ValueError, match="how: expected"):
        M.recall_at_k(RANKED, GOLD, 1, WORLDS, how="weighted")


def _loop_reference(ranked, gold, worlds, k, pred):
    """Obviously correct per-mention loop: (recall micro, recall macro, nacc micro, nacc macro)."""
    by_world: dict = {}
    hits, nacc_num, nacc_den = [], 0, 0
    for r, g, w, p in zip(ranked.tolist(), gold.tolist(), worlds.tolist(), pred.tolist()):
        hit = g != -1 and g in r[:k]
        hits.append(hit)
        d = by_world.setdefault(w, [0, 0, 0, 0])
        d[0] += hit
        d[1] += 1
        if hit:
            d[2] += p == g
            d[3] += 1
            nacc_num += p == g
            nacc_den += 1
    rec_macro = np.mean([d[0] / d[1] for d in by_world.values()])
    nacc_macro = np.mean([d[2] / d[3] for d in by_world.values() if d[3]])
    return sum(hits) / len(hits), rec_macro, nacc_num / nacc_den, nacc_macro


def test_random_against_loop_reference():
    rng = np.random.default_rng(0)
    n, c, n_ent = 300, 16, 40
    scores = rng.integers(0, 4, size=(n, c)).astype(float)  # many ties
    ids = np.stack([rng.choice(n_ent, size=c, replace=False) for _ in range(n)])
    ids[rng.random((n, c)) < 0.1] = -1
    gold = rng.integers(-1, n_ent, size=n)
    worlds = rng.choice(np.array(["w0", "w1", "w2", "w3"]), size=n, p=[0.6, 0.25, 0.1, 0.05])
    ranked = M.rank_by_score(ids, scores)
    pred = ranked[:, 1]
    for k in (1, 5, 16, 64):
        ref = _loop_reference(ranked, gold, worlds, k, pred)
        got = (
            M.recall_at_k(ranked, gold, k),
            M.recall_at_k(ranked, gold, k, worlds, "macro"),
            M.normalized_accuracy(pred, ranked, gold, k),
            M.normalized_accuracy(pred, ranked, gold, k, worlds, "macro"),
        )
        assert got == pytest.approx(ref)


def test_linking_report_shape_and_counts():
    pred = np.array([10, 20, 30, 40, 52, 61])
    rep = M.linking_report(RANKED, GOLD, WORLDS, ks=(1, 3), pred=pred, k_norm=3)
    assert rep["n_mentions"] == 6 and rep["n_gold_not_in_kb"] == 1
    assert rep["recall@3"]["micro"] == pytest.approx(4 / 6)
    assert rep["recall@3"]["per_world"]["a"] == {"value": 0.5, "count": 4}
    assert rep["normalized_accuracy@3"]["macro"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert rep["accuracy"]["micro"] == pytest.approx(2 / 6)
    # without pred, accuracy is the retriever's top-1 accuracy (= recall@1)
    assert M.linking_report(RANKED, GOLD, WORLDS, ks=(1,))["accuracy"]["micro"] == pytest.approx(2 / 6)


def test_linking_report_refuses_a_recall_cut_off_above_the_ranked_list():
    """Recall@k' of a top-K list with k' > K would repeat recall@K as if it had been measured."""
    width = np.asarray(RANKED).shape[1]
    with pytest.raises(ValueError, match=rf"recall@\[{width + 1}\] needs that many ranked candidates, got K={width}"):
        M.linking_report(RANKED, GOLD, WORLDS, ks=(1, width + 1))
    with pytest.raises(ValueError, match="needs that many"):
        M.linking_report(RANKED, GOLD, WORLDS, ks=(1,), pred=np.zeros(len(GOLD), int), k_norm=width + 1)
    assert f"recall@{width}" in M.linking_report(RANKED, GOLD, WORLDS, ks=(1, width))


def test_recall_cut_offs_stop_at_k():
    from dist_nce.eval.zeshel import recall_ks

    assert recall_ks(64) == [1, 4, 8, 16, 32, 64] and recall_ks(16) == [1, 4, 8, 16]
    assert recall_ks(10) == [1, 4, 8, 10] and recall_ks(100) == [1, 4, 8, 16, 32, 64, 100] and recall_ks(1) == [1]
