"""BLINK's benchmark table (dist_nce.eval.blink): hand-counted mentions, and BLINK's own loops as the reference."""
from __future__ import annotations

import numpy as np
import pytest

from dist_nce.eval.blink import COLUMNS, blink_scores, format_table, linked_rows, page_id


def test_page_ids_are_read_as_blink_reads_them():
    assert [page_id(x) for x in ("887850", " 12 ", "000123", 7, "-3")] == ["887850", "12", "123", "7", "-3"]
    assert [page_id(x) for x in ("", "abc", "12.5", None)] == [None, None, None, None]


def test_hand_counted():
    # rows of 5 mentions, k = 3; mention 3's gold is not in the KB (-1): dropped, support 4
    ranked = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42], [50, 51, 52]]
    gold = [10, 22, 33, -1, 51]
    top1 = [11, 22, 30, 40, 51]  # the cross-encoder's choice per mention
    s = blink_scores(ranked, gold, top1)
    assert (s["lines"], s["support"], s["k"]) == (5, 4, 3)
    t = s["table"]
    assert list(t) == list(COLUMNS) and t["support"] == 4
    assert t["biencoder accuracy"] == 1 / 4  # mention 0 only
    # BLINK's "recall at 100" counts the first k - 1 candidates: 10 and 51 (22 is third), where recall@3 has 22 too
    assert t["recall at 100"] == 2 / 4 and s["recall@3"] == 3 / 4
    # normalized: over mentions 0, 1, 4 (gold among the 3): right on 1 and 4
    assert t["crossencoder normalized accuracy"] == 2 / 3
    assert t["overall unormalized accuracy"] == pytest.approx(2 / 3 * 3 / 4)
    line = format_table("testb", s)
    assert line.startswith("testb: biencoder accuracy: 0.2500, recall at 100: 0.5000, ") and "support: 4" in line
    assert line.endswith("(recall@3: 0.7500)")


def test_what_blink_would_print_as_minus_one_is_none():
    s = blink_scores([[1, 2]], [2])
    assert s["table"]["crossencoder normalized accuracy"] is None and s["table"]["overall unormalized accuracy"] is None
    assert s["table"]["recall at 100"] == 0.0 and s["recall@2"] == 1.0
    assert blink_scores([[1]], [1])["table"]["recall at 100"] is None  # k = 1: BLINK's loop is empty
    nothing = blink_scores([[1, 2]], [-1], [1])
    assert nothing["support"] == 0 and all(nothing["table"][c] is None for c in COLUMNS[:-1])
    # no gold among the candidates: the normalized accuracy has no mention to count
    s = blink_scores([[1, 2]], [3], [1])
    assert s["table"]["crossencoder normalized accuracy"] is None and s["table"]["biencoder accuracy"] == 0.0
    assert format_table("x", s).count(": -") == 2


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"ranked \[N, k\] and gold \[N\]"):
        blink_scores([[1, 2]], [1, 2])
    with pytest.raises(ValueError, match=r"reranked_top1 \[N\]"):
        blink_scores([[1, 2]], [1], [1, 2])


def blink_reference(nns: list[list[int]], labels: list[int], top1: list[int], in_kb: list[bool]) -> list:
    """BLINK's counting written out as main_dense.run does it: the mentions not in the KB skipped when the
    test file is read, recall from its range(1, top_k) loop, the cross-encoder's accuracy over the mentions
    whose label is among the candidates (filter_crossencoder_tensor_input), unnormalized = that x kept / all."""
    kept = [i for i in range(len(labels)) if in_kb[i]]
    labels = [labels[i] for i in kept]
    nns = [nns[i] for i in kept]
    top1 = [top1[i] for i in kept]
    y = []
    for i in range(1, len(nns[0])):
        y.append(sum(1.0 for label, top in zip(labels, nns) if label in top[:i]) / len(labels))
    inside = [j for j in range(len(labels)) if labels[j] in nns[j]]
    normalized = sum(1.0 for j in inside if top1[j] == labels[j]) / len(inside)
    return [y[0], y[-1], normalized, normalized * len(inside) / len(labels), len(labels)]


def test_random_sets_match_blinks_counting():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, k = int(rng.integers(1, 30)), int(rng.integers(2, 12))
        nns = [list(rng.permutation(40)[:k]) for _ in range(n)]
        labels = [int(rng.integers(0, 40)) if rng.random() < 0.7 else int(row[rng.integers(0, k)]) for row in nns]
        in_kb = list(rng.random(n) < 0.85)
        in_kb[0] = True
        labels[0] = int(nns[0][0])  # one supported gold among the candidates, as BLINK's division needs
        top1 = [int(row[rng.integers(0, k)]) if rng.random() < 0.6 else label for row, label in zip(nns, labels)]
        got = blink_scores(nns, [g if ok else -1 for g, ok in zip(labels, in_kb)], top1)
        assert [got["table"][c] for c in COLUMNS] == pytest.approx(blink_reference(nns, labels, top1, in_kb))


def test_linked_rows_recover_the_retrievers_order():
    plain = [{"row": 4, "score": 3.0}, {"row": 9, "score": 2.0}]
    assert linked_rows(plain) == ([4, 9], None)
    # reranked: listed by rerank_score; the retriever's order comes back from its scores
    reranked = [{"row": 9, "score": 2.0, "rerank_score": 5.0}, {"row": 7, "score": 1.0, "rerank_score": 4.0},
                {"row": 4, "score": 3.0, "rerank_score": 1.0}]
    assert linked_rows(reranked) == ([4, 9, 7], 9)
    assert linked_rows([]) == ([], None)
