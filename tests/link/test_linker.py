"""Linker.from_pretrained(run).link(docs): training's tokenization, exact rankings, reranker, refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.link import Linker
from dist_nce.modeling.reranker import Reranker
from dist_nce.modeling.retriever import Retriever
from dist_nce.modeling.scoring import score_all
from kb.store import EntityStore, MentionTable


@pytest.fixture(scope="module")
def linker(tiny_run):
    return Linker.from_pretrained(tiny_run, k=5, progress=False)


def dev_docs(dev_file) -> list[dict]:
    return [json.loads(line) for line in open(dev_file, encoding="utf-8")]


def test_kilt_inputs_are_tokenized_exactly_as_the_prepared_dev_mentions(linker, dev_file):
    docs = dev_docs(dev_file)
    prepared = linker.prepare(docs)
    table = MentionTable(linker.artifacts.store, "dev")
    assert table.mention_ids == [d["id"] for d in docs]
    np.testing.assert_array_equal(prepared.ids, table.token_ids(np.arange(len(table))))
    np.testing.assert_array_equal(prepared.lengths, table.lengths)


def test_many_spans_over_a_long_text_tokenize_as_each_alone(linker):
    """prepare cuts records a chunk at a time: more spans than a chunk, over a text longer than the
    tokenizer's window, give the rows of the per-record reference."""
    from dist_nce.core.text import encode_mention
    from dist_nce.link.linker import PREPARE_CHUNK

    words = [f"w{i % 97} Tulsa-{i}" for i in range(3000)]
    text = " ".join(words)
    starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
    picks = range(0, 3000, 3000 // (PREPARE_CHUNK + 9))
    doc = {"text": text, "mentions": [[int(starts[i]), int(starts[i]) + len(words[i])] for i in picks]}
    prepared = linker.prepare([doc])
    assert len(prepared.mentions) > PREPARE_CHUNK
    for row, m in zip(range(len(prepared.mentions)), prepared.mentions):
        r = m.record
        want = encode_mention(linker.tokenizer, r.left, r.mention, r.right, linker.mention_max_len)
        assert prepared.ids[row, :prepared.lengths[row]].tolist() == want


def test_rankings_are_the_exact_top_k_over_all_entities(linker, tiny_run, dev_file):
    docs = dev_docs(dev_file) + [{"text": "Tulsa lies in Oklahoma near Arkansas .", "mentions": [[14, 22], [28, 36]]}]
    got = linker.link(docs)
    # brute force: every (mention, entity) score from a fresh load of the exported model
    r = Retriever.from_pretrained(tiny_run / "model").eval()
    store = EntityStore(linker.artifacts.store)
    prepared = linker.prepare(docs)
    rows = np.arange(len(store))
    with torch.no_grad():
        ids, lens = torch.from_numpy(store.token_ids(rows).astype(np.int64)), torch.from_numpy(store.lengths(rows))
        e = r.encode_entities(ids, torch.arange(ids.shape[1])[None] < lens[:, None].long())
        mids = torch.from_numpy(prepared.ids.astype(np.int64))
        x = r.encode_mentions(mids, torch.arange(mids.shape[1])[None] < torch.from_numpy(prepared.lengths)[:, None])
        brute = score_all(r.spec, x, e).numpy()
    flat = [m for d in got for m in d["mentions"]]
    assert len(flat) == len(prepared.mentions) == len(docs) + 1
    assert got[-1]["mentions"][1]["span"] == [28, 36] and got[-1]["mentions"][1]["mention"] == "Arkansas"
    assert got[0]["id"] == docs[0]["id"] and "id" not in got[-1]
    titles, sources = store.titles(rows), store.source_ids(rows)
    for i, m in enumerate(flat):
        want = np.argsort(-brute[i], kind="stable")[:5]
        got_rows = [e["row"] for e in m["entities"]]
        assert got_rows == want.tolist(), (i, got_rows, want, brute[i][want])
        np.testing.assert_allclose([e["score"] for e in m["entities"]], brute[i][want], atol=1e-4)
        assert [e["title"] for e in m["entities"]] == [titles[j] for j in want]
        assert [e["id"] for e in m["entities"]] == [sources[j] for j in want]
    # the spread is real: the top 1 differs between mentions, so equal answers are not a constant
    assert len({m["entities"][0]["row"] for m in flat}) > 1


def test_snapshot_and_in_process_encoding_agree(linker, tiny_run, dev_file):
    docs = dev_docs(dev_file)
    encoded = Linker.from_pretrained(tiny_run, k=5, progress=False, kb="encode").link(docs)
    for a, b in zip(linker.link(docs), encoded):
        assert [e["row"] for e in a["mentions"][0]["entities"]] == [e["row"] for e in b["mentions"][0]["entities"]]


def test_reranker_scores_and_reorders(tiny_run, tiny_reranker, dev_file):
    docs = dev_docs(dev_file)[:4]
    plain = Linker.from_pretrained(tiny_run, k=4, progress=False).link(docs)
    linker = Linker.from_pretrained(tiny_run, k=4, progress=False, reranker=str(tiny_reranker), rerank_pairs=6)
    got = linker.link(docs)
    rr = Reranker.from_pretrained(tiny_reranker).eval()
    prepared = linker.prepare(docs)
    moved = 0
    for i, (a, b) in enumerate(zip(plain, got)):
        ents = b["mentions"][0]["entities"]
        # the same k candidates, each with its retriever score, ordered by reranker score
        assert sorted(e["row"] for e in ents) == sorted(e["row"] for e in a["mentions"][0]["entities"])
        rerank = [e["rerank_score"] for e in ents]
        assert rerank == sorted(rerank, reverse=True)
        with torch.no_grad():
            want = rr.score(torch.from_numpy(prepared.ids[i:i + 1].astype(np.int64)),
                            torch.from_numpy(linker.store.token_ids(np.array([[e["row"] for e in ents]]))
                                             .astype(np.int64)))[0].numpy()
        np.testing.assert_allclose(rerank, want, atol=1e-5)
        moved += [e["row"] for e in ents] != [e["row"] for e in a["mentions"][0]["entities"]]
    assert moved > 0, "the reranker never changed an order: the test would not see it ignored"


def test_bad_requests_raise_value_errors_naming_doc_and_field(linker):
    good = {"text": "Paris is in France .", "mentions": [[12, 18]]}
    for docs, needle in (([good, {"text": "Paris"}], "doc 1: field 'mentions': missing"),
                         ([good, good, {"text": "Paris", "mentions": [[0, 50]]}], "doc 2: field 'mentions[0]'"),
                         ([{"text": "", "mentions": [[0, 1]]}], "doc 0: field 'text': empty text")):
        with pytest.raises(ValueError) as e:
            linker.link(docs)
        assert needle in str(e.value)
    for k in (0, 61, 2.0):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 60\]"):
            linker.link([good], k=k)
    assert len(linker.link([good], k=60)[0]["mentions"][0]["entities"]) == 60


def test_a_snapshot_of_other_weights_or_another_kb_is_refused(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    snap = json.loads((run / "kb_snapshot" / "manifest.json").read_text())
    part = tmp_path / "part"
    shutil.copytree(snap["parts"][0]["dir"], part)
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["encoder_fingerprint"] = "0" * 32
    (part / "manifest.json").write_text(json.dumps(manifest))
    snap["parts"][0]["dir"] = str(part)
    (run / "kb_snapshot" / "manifest.json").write_text(json.dumps(snap))
    with pytest.raises(ArtifactMismatch, match="other entity-encoder weights"):
        Linker.from_pretrained(run, progress=False)
    ids = (run / "kb_snapshot" / "ids.txt").read_text().splitlines()
    (run / "kb_snapshot" / "ids.txt").write_text("\n".join(ids[::-1]) + "\n")
    with pytest.raises(ArtifactMismatch, match="indexes another KB"):
        Linker.from_pretrained(run, progress=False)


def test_unknown_config_keys_and_missing_artifacts_are_named(tiny_run, tmp_path):
    from dist_nce.core.config import ConfigError

    with pytest.raises(ConfigError, match="kk: unknown key"):
        Linker.from_pretrained(tiny_run, kk=3)
    with pytest.raises(FileNotFoundError, match="no exported retriever"):
        Linker.from_pretrained(tmp_path)
    run = tmp_path / "nosnap"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / "kb_snapshot")
    with pytest.raises(FileNotFoundError, match="kb encode"):
        Linker.from_pretrained(run, progress=False)
