"""Gold insertion for reranker training, against a per-row list reference."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dist_nce.rerank.candidates import candidates_path, gold_first, num_candidates_problem, read_split_candidates


def reference(row: list[int], gold: int) -> list[int]:
    """The paper's loader, on one list: append the gold if missing, gold first, cut to C."""
    c = len(row)
    xs = [x for x in row if x != -1]
    if gold not in xs:
        xs.append(gold)
    xs = [gold] + [x for x in xs if x != gold]
    return (xs + [-1] * c)[:c]


def test_matches_reference_on_random_rows():
    rng = np.random.default_rng(0)
    n, c = 300, 6
    rows = np.stack([rng.permutation(20)[:c] for _ in range(n)])
    short = rng.random(n) < 0.3  # lists shorter than C end in empty slots
    for i in np.flatnonzero(short):
        rows[i, rng.integers(1, c):] = -1
    gold = np.where(rng.random(n) < 0.5, rows[np.arange(n), rng.integers(0, c, n)], rng.integers(0, 20, n))
    gold = np.where(gold < 0, 19, gold)
    got, inserted = gold_first(rows, gold)
    for i in range(n):
        assert got[i].tolist() == reference(rows[i].tolist(), int(gold[i])), (rows[i], gold[i])
        assert inserted[i] == (gold[i] not in rows[i])
    assert inserted.any() and (~inserted).any() and short.any()


def test_cases():
    rows = np.array([[5, 7, 9], [5, 7, 9], [5, -1, -1], [9, 5, 7]])
    got, inserted = gold_first(rows, np.array([7, 3, 3, 7]))
    assert got.tolist() == [[7, 5, 9],  # present: moved to the front, order of the rest kept
                            [3, 5, 7],  # missing, full list: the lowest-ranked (9) drops out
                            [3, 5, -1],  # missing, short list: fills an empty slot, nothing drops
                            [7, 9, 5]]
    assert inserted.tolist() == [False, True, True, False]


def test_errors():
    with pytest.raises(ValueError, match="gold row -1 at mention 1"):
        gold_first(np.array([[1, 2], [3, 4]]), np.array([1, -1]))
    with pytest.raises(ValueError, match="C >= 2"):
        gold_first(np.array([[1], [3]]), np.array([1, 3]))
    with pytest.raises(ValueError, match=r"rows \[N, C\] and gold \[N\]"):
        gold_first(np.array([1, 2]), np.array([1]))


def test_candidate_files_by_format(tmp_path):
    (tmp_path / "candidates_val.json").write_text(json.dumps({"mention_id": "m", "candidates": ["a", "b"]}) + "\n")
    (tmp_path / "val.json").write_text(json.dumps({"mention_id": "m", "tfidf_candidates": ["c"]}) + "\n")
    assert read_split_candidates(tmp_path, "val", "retriever")[0] == {"m": ["a", "b"]}
    assert read_split_candidates(tmp_path, "val", "tfidf") == ({"m": ["c"]}, tmp_path / "val.json")
    assert candidates_path(tmp_path, "test", "tfidf").name == "test.json"
    with pytest.raises(FileNotFoundError, match="candidates_test.json: no retriever candidates for split 'test'") as e:
        read_split_candidates(tmp_path, "test", "retriever")
    # The error says which command writes the directory (the reranker writes no candidates).
    assert "jobs/zeshel_retriever.py" in str(e.value) and "runs/zeshel_tiny/candidates" in str(e.value)


def test_num_candidates_is_bounded_by_the_longest_list():
    lists = {"m1": ["a", "b", "c"], "m2": ["d", "e"]}  # a short list is padded, not a limit
    assert num_candidates_problem(lists, "x/candidates_val.json", 3) is None
    assert num_candidates_problem(lists, "x/candidates_val.json", 2) is None  # the top C are used
    assert num_candidates_problem(lists, "x/candidates_val.json", 4) == (
        "data.num_candidates: 4: x/candidates_val.json holds at most 3 candidates per mention (longest of its 2 "
        "lists); C must be 3 or fewer (a smaller C uses each list's top C)")


def test_a_file_the_directorys_manifest_does_not_list_is_refused(tmp_path):
    """A retriever rerun over fewer splits rewrote the manifest and left an earlier run's candidates_test.json:
    read as if the later run had written it, it silently mixed two retrievers' candidates."""
    from dist_nce.core.artifacts import write_manifest
    from dist_nce.eval.zeshel import CANDIDATES_KIND, CandidateFileError

    for split in ("val", "test"):
        (tmp_path / f"candidates_{split}.json").write_text(json.dumps({"mention_id": "m", "candidates": ["a"]}) + "\n")
    write_manifest(tmp_path, CANDIDATES_KIND, 1, k=1, splits={"val": {"file": "candidates_val.json"}})
    assert read_split_candidates(tmp_path, "val", "retriever")[0] == {"m": ["a"]}
    with pytest.raises(CandidateFileError, match=r"candidates_test\.json: not written by the retriever run that "
                                                 r".*manifest\.json describes \(it lists val\): an earlier run's file"):
        read_split_candidates(tmp_path, "test", "retriever")
    (tmp_path / "manifest.json").unlink()  # a directory without a manifest (by hand): read as it is
    assert read_split_candidates(tmp_path, "test", "retriever")[0] == {"m": ["a"]}
