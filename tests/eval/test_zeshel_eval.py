"""Zeshel evaluation on a tiny synthetic Zeshel tree: own-world vs split-union recall,
candidate files (ours and Zeshel's TF-IDF format), reranker accuracy."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dist_nce.core.text import load_tokenizer
from dist_nce.eval.zeshel import (
    CandidateFileError, build_world_indexes, candidate_rows, evaluate_reranker_split,
    evaluate_retriever_split, read_candidates, read_tfidf_candidates, recall_report, rerank, retrieve_worlds,
    split_world_ranges, write_candidates,
)
from dist_nce.modeling.encoder import load_transformer
from dist_nce.modeling.reranker import Reranker, RerankerConfig
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from dist_nce.modeling.scoring import score_all
from dist_nce.retrieval import ranked_source_ids
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_zeshel

WORLDS = ["muppets", "coronation_street", "lego", "yugioh"]  # 2 val + 2 test worlds
PER_WORLD = 30


@pytest.fixture(scope="module")
def zeshel(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("zeshel_eval")
    write_zeshel(root / "src", WORLDS, PER_WORLD, 12, seed=1)
    prepare(PrepareConfig(out=str(root / "kb"), zeshel_root=str(root / "src"), model_dir=tiny_model_dir,
                          entity_max_len=48, mention_max_len=32, progress=False), log=lambda _: None)
    return root, EntityStore(root / "kb")


@pytest.fixture(scope="module")
def retriever(tiny_model_dir):
    torch.manual_seed(0)
    r = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir, storage_dtype="float32")).eval()
    # A random tiny BERT maps every text to nearly the same vector (scores equal to 1e-6);
    # noise on every weight spreads the scores so rankings are well defined.
    with torch.no_grad():
        for p in r.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return r


def brute_scores(r: Retriever, store: EntityStore, mentions: MentionTable) -> np.ndarray:
    def enc(fn, ids, lengths):
        ids = torch.from_numpy(ids.astype(np.int64))
        with torch.no_grad():
            return fn(ids, torch.arange(ids.shape[1])[None] < torch.tensor(lengths, dtype=torch.int64)[:, None])
    rows = np.arange(len(store))
    e = enc(r.encode_entities, store.token_ids(rows), store.lengths(rows))
    x = enc(r.encode_mentions, mentions.token_ids(np.arange(len(mentions))), mentions.lengths)
    return score_all(r.spec, x, e).numpy()


def hits(s: np.ndarray, gold: np.ndarray, allowed: list[np.ndarray], k: int) -> np.ndarray:
    """gold among the k best allowed rows of each mention (brute force)."""
    out = []
    for i, rows in enumerate(allowed):
        top = rows[np.argsort(-s[i, rows], kind="stable")][:k]
        out.append(gold[i] in top)
    return np.array(out)


def test_split_world_ranges(zeshel):
    root, store = zeshel
    val = MentionTable(root / "kb", "val")
    assert split_world_ranges(store, val) == {w: store.world_ranges()[w] for w in ["coronation_street", "muppets"]}
    assert sorted(set(val.worlds)) == ["coronation_street", "muppets"]
    bare = type("M", (), {"worlds": ["lego", "starwars"], "split": "val", "path": "x"})()
    with pytest.raises(ValueError, match=r"no entities for worlds \['starwars'\]"):
        split_world_ranges(store, bare)


def test_own_world_and_union_recall_equal_brute_force(zeshel, retriever):
    root, store = zeshel
    mentions = MentionTable(root / "kb", "val")
    ranges = split_world_ranges(store, mentions)
    indexes = build_world_indexes(retriever, store, ranges, progress=False)
    k = 6
    res = retrieve_worlds(retriever, mentions, indexes, k=k, batch_size=5, progress=False)
    s, gold = brute_scores(retriever, store, mentions), mentions.gold_rows
    own_rows = [np.arange(*ranges[w]) for w in mentions.worlds]
    union_rows = np.concatenate([np.arange(a, b) for a, b in ranges.values()])
    assert all(np.isin(res.own.rows[i], own_rows[i]).all() for i in range(len(mentions)))
    assert np.isin(res.union.rows, union_rows).all()
    rep = recall_report(res, gold, ks=(1, k))
    worlds = np.array(mentions.worlds)
    for name, allowed in (("own_world", own_rows), ("split_union", [union_rows] * len(mentions))):
        for kk in (1, k):
            h = hits(s, gold, allowed, kk)
            got = rep[name][f"recall@{kk}"]
            assert got["micro"] == pytest.approx(h.mean())
            per = {w: h[worlds == w].mean() for w in sorted(set(worlds))}
            assert got["macro"] == pytest.approx(np.mean(list(per.values())))
            assert {w: v["value"] for w, v in got["per_world"].items()} == pytest.approx(per)
    # Restricting to the gold's own world can only move the gold up.
    for kk in (1, k):
        own, union = rep["own_world"][f"recall@{kk}"]["micro"], rep["split_union"][f"recall@{kk}"]["micro"]
        assert own >= union
    assert (res.own.rows != res.union.rows).any()  # the two settings differ on this data


def test_candidates_file_round_trip(zeshel, retriever, tmp_path):
    root, store = zeshel
    mentions = MentionTable(root / "kb", "test")
    path = tmp_path / "cands" / "test.jsonl"
    report = evaluate_retriever_split(retriever, store, mentions, k=64, candidates_path=path, progress=False)
    assert report["own_world"]["recall@64"]["micro"] == 1.0  # 30 entities per world < 64
    assert sorted(p.name for p in path.parent.iterdir()) == ["test.jsonl"]  # atomic: no temporary left
    read = read_candidates(path)
    assert list(read) == mentions.mention_ids
    assert all(len(v) == PER_WORLD for v in read.values())
    cands = candidate_rows(read, mentions, store, k=64)
    assert ranked_source_ids(store, cands.rows) == list(read.values())
    np.testing.assert_array_equal(cands.rows[np.arange(len(mentions)), cands.gold_pos], mentions.gold_rows)
    assert cands.n_gold_not_in_candidates == 0 and cands.n_unknown_documents == 0
    write_candidates(tmp_path / "again.jsonl", list(read), list(read.values()))
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_candidates_reader_errors(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"mention_id": "a", "candidates": ["x"]}\n{"mention_id": "a", "candidates": []}\n')
    with pytest.raises(CandidateFileError, match=r"c.jsonl:2: mention_id 'a' again \(first at line 1\)"):
        read_candidates(p)
    p.write_text('{"mention_id": "a", "candidates": ["x", 3]}\n')
    with pytest.raises(CandidateFileError, match=r"c.jsonl:1: expected 'candidates'"):
        read_candidates(p)
    p.write_text('{"mention_id": "a", "tfidf_candidates": ["x"]}\n{"mention_id": \n')
    with pytest.raises(CandidateFileError, match=r"c.jsonl:2: not JSON"):
        read_tfidf_candidates(p)


def test_tfidf_candidates_and_gold_not_in_candidates(zeshel, tmp_path):
    """Zeshel's tfidf_candidates lines -> rows; unknown ids dropped and counted; golds left
    out of the list counted; a mention without a line is an error."""
    root, store = zeshel
    mentions = MentionTable(root / "kb", "val")
    gold_docs = store.source_ids(mentions.gold_rows)
    a, b = store.world_ranges()["muppets"]
    others = store.source_ids(np.arange(a, a + 5))
    lines, want_pos = [], []
    for i, mid in enumerate(mentions.mention_ids):
        docs = [d for d in others if d != gold_docs[i]][:4]
        if i % 3 == 0:
            docs.insert(2, gold_docs[i])  # gold third
        if i == 1:
            docs.insert(0, "NOT-A-DOCUMENT")
        lines.append(json.dumps({"mention_id": mid, "tfidf_candidates": docs}))
        want_pos.append(2 if i % 3 == 0 else -1)
    lines.append(json.dumps({"mention_id": "not-in-table", "tfidf_candidates": others}))
    path = tmp_path / "val.json"
    path.write_text("\n".join(lines) + "\n")
    cands = candidate_rows(read_tfidf_candidates(path), mentions, store, k=4, source=str(path))
    np.testing.assert_array_equal(cands.gold_pos, want_pos)
    assert cands.n_gold_not_in_candidates == sum(p < 0 for p in want_pos) > 0
    assert cands.n_unknown_documents == 1 and cands.n_extra_mentions == 1
    assert cands.n_truncated == sum(1 for p in want_pos if p == 2)  # 5 known ids > k=4
    assert store.source_ids(cands.rows[1]) == [d for d in others if d != gold_docs[1]][:4]
    del_one = dict(read_tfidf_candidates(path))
    del del_one[mentions.mention_ids[3]]
    with pytest.raises(CandidateFileError, match=rf"no candidates for 1 of {len(mentions)} mentions"):
        candidate_rows(del_one, mentions, store, k=4, source=str(path))


@pytest.fixture(scope="module")
def reranker(tiny_model_dir):
    torch.manual_seed(0)
    return Reranker(RerankerConfig(model=tiny_model_dir, max_len=48), load_transformer(tiny_model_dir),
                    load_tokenizer(tiny_model_dir)).eval()


def test_rerank_picks_the_best_scored_real_candidate(zeshel, reranker):
    root, store = zeshel
    mentions = MentionTable(root / "kb", "test")
    rng = np.random.default_rng(0)
    n = 7
    rows = rng.integers(0, len(store), size=(n, 5))
    rows[1, 2:] = -1
    rows[4, :] = -1
    sub = type("Sub", (), {"token_ids": lambda self, i: mentions.token_ids(np.asarray(i)), "split": "test"})()
    pred = rerank(reranker, sub, store, rows, batch_size=3, progress=False)
    for i in range(n):
        real = rows[i][rows[i] >= 0]
        if not len(real):
            assert pred[i] == -1
            continue
        with torch.no_grad():  # one mention at a time, only its real candidates
            s = reranker.score(torch.from_numpy(mentions.token_ids([i]).astype(np.int64)),
                               torch.from_numpy(store.token_ids(real[None]).astype(np.int64)))[0]
        assert pred[i] == real[int(s.argmax())]


def test_reranker_report_table2_definitions(zeshel, reranker, tmp_path):
    """U.Acc over all mentions; N.Acc over mentions whose gold is a candidate; macro over worlds."""
    root, store = zeshel
    mentions = MentionTable(root / "kb", "val")
    gold = mentions.gold_rows
    cands = {}
    for i, mid in enumerate(mentions.mention_ids):
        a, _ = store.world_ranges()[mentions.worlds[i]]
        docs = store.source_ids(np.arange(a, a + 3))
        if i % 2 == 0:
            docs = [store.source_ids([gold[i]])[0]] + [d for d in docs if d != store.source_ids([gold[i]])[0]][:2]
        cands[mid] = docs
    rep = evaluate_reranker_split(reranker, store, mentions, cands, k=3, batch_size=4, progress=False)
    cset = candidate_rows(cands, mentions, store, k=3)
    pred = rerank(reranker, mentions, store, cset.rows, batch_size=5, progress=False)
    ok, has = pred == gold, cset.gold_pos >= 0
    worlds = np.array(mentions.worlds)
    assert rep["unnormalized_accuracy"]["micro"] == pytest.approx(ok.mean())
    assert rep["normalized_accuracy"]["micro"] == pytest.approx(ok[has].mean())
    assert rep["unnormalized_accuracy"]["micro"] == pytest.approx(
        rep["normalized_accuracy"]["micro"] * rep["candidate_recall@3"]["micro"])
    per = [ok[(worlds == w) & has].mean() for w in sorted(set(worlds))]
    assert rep["normalized_accuracy"]["macro"] == pytest.approx(np.mean(per))
    assert rep["n_gold_not_in_candidates"] == int((~has).sum()) and rep["n_mentions"] == len(mentions)
    first = cset.rows[:, 0] == gold  # the retriever's own top-1 on the same mentions
    assert 0 < first.sum() < len(first)
    assert rep["retriever_recall@1"]["micro"] == pytest.approx(first.mean())
    assert rep["retriever_recall@1"]["macro"] == pytest.approx(
        np.mean([first[worlds == w].mean() for w in sorted(set(worlds))]))
