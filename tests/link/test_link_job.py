"""jobs/link.py as a user runs it (a subprocess): one sentence, JSONL batch, KILT guesses, interactive."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_job(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "jobs/link.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, input=stdin, env=env)


@pytest.fixture(scope="module")
def api(tiny_run):
    from dist_nce.link import Linker

    return Linker.from_pretrained(tiny_run, k=3, progress=False)


def test_one_sentence_prints_the_ranked_entities(tiny_run, api):
    r = run_job("--run", str(tiny_run), "--k", "3", "--text", "Tulsa lies in [Oklahoma] near [Arkansas] .")
    assert r.returncode == 0, r.stderr
    want = api.link([{"text": "Tulsa lies in Oklahoma near Arkansas .", "mentions": [[14, 22], [28, 36]]}])[0]
    lines = r.stdout.splitlines()
    assert lines[0] == "'Oklahoma' [14, 22)" and lines[4] == "'Arkansas' [28, 36)"
    for block, m in ((lines[1:4], want["mentions"][0]), (lines[5:8], want["mentions"][1])):
        for rank, (line, e) in enumerate(zip(block, m["entities"]), 1):
            assert line.split()[0] == f"{rank}." and f" {e['title']} " in line and f"id {e['id']} " in line


@pytest.mark.slow
def test_batch_jsonl_equals_the_python_api_and_kilt_guesses(tiny_run, api, dev_file, tmp_path, monkeypatch):
    docs = [json.loads(line) for line in open(dev_file, encoding="utf-8")]
    docs.append({"text": "Paris is in France .", "mentions": [[12, 18], [0, 5]], "source": {"page": 3}})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("an older file\n")
    r = run_job("--run", str(tiny_run), "--k", "3", "--input", str(src), "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert f"linked {len(docs) + 1} mentions in {len(docs)} documents" in r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want = api.link(docs)
    assert [[[e["row"] for e in m["entities"]] for m in d["mentions"]] for d in got] == \
        [[[e["row"] for e in m["entities"]] for m in d["mentions"]] for d in want]
    # the same documents: every field the input had (KILT's id/input/output, a user's own), the mentions
    # linked in place (their spans as given)
    for d, g in zip(docs, got):
        assert {k: v for k, v in g.items() if k != "mentions"} == {k: v for k, v in d.items() if k != "mentions"}
    assert got[-1]["source"] == {"page": 3} and [m["span"] for m in got[-1]["mentions"]] == [[12, 18], [0, 5]]
    assert [m["mention"] for m in got[-1]["mentions"]] == ["France", "Paris"]
    # stopped part way (Ctrl-C after the first chunk was written): the file before it is left as it was
    from dist_nce.cli import link as cli

    class Stopped:
        config, calls = api.config, 0

        def link(self, docs, progress=None):
            Stopped.calls += 1
            if Stopped.calls == 2:
                raise KeyboardInterrupt
            return api.link(docs, progress=progress)

    kept = out.read_text()
    monkeypatch.setattr(cli, "CHUNK", 2)
    args = argparse.Namespace(output=str(out), format="jsonl")
    with pytest.raises(KeyboardInterrupt):
        cli.batch(Stopped(), args, list(enumerate(docs, 1)))
    assert Stopped.calls == 2 and out.read_text() == kept
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")] == []  # no temporary left
    # KILT guess lines: one per id, answer = top-1 title, provenance = the ranked ids
    guess = tmp_path / "guess.jsonl"
    r = run_job("--run", str(tiny_run), "--k", "3", "--input", str(dev_file), "--output", str(guess),
                "--format", "kilt", "--no-progress")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in guess.read_text().splitlines()]
    assert [g["id"] for g in lines] == [d["id"] for d in docs[:-1]]
    for g, w in zip(lines, want):
        ents = w["mentions"][0]["entities"]
        assert g["output"][0]["answer"] == ents[0]["title"]
        assert [p["wikipedia_id"] for p in g["output"][0]["provenance"]] == [e["id"] for e in ents]


def test_bad_input_is_named_by_file_and_line(tiny_run, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"text": "ok", "mentions": [[0, 2]]}) + "\n" +
                   json.dumps({"text": "Paris", "mentions": [[0, 9]]}) + "\n")
    r = run_job("--run", str(tiny_run), "--input", str(src))
    assert r.returncode == 2 and f"{src}:2: field 'mentions[0]': span [0, 9) is outside" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_job("--run", str(tiny_run), "--text", "no brackets here")
    assert r.returncode == 2 and "mark at least one mention" in r.stderr
    r = run_job("--run", str(tiny_run), "--set", "kk=1", "--text", "[a]")
    assert r.returncode == 2 and "kk: unknown key for LinkConfig" in r.stderr


def test_interactive_reads_stdin_and_survives_a_bad_line(tiny_run, api):
    r = run_job("--run", str(tiny_run), "--k", "2", "--interactive",
                stdin="Paris is in [France] .\nbad [line\n\nthe [Alps] are high\n")
    assert r.returncode == 0, r.stderr
    assert "error: '[' without ']'" in r.stderr
    heads = [line for line in r.stdout.splitlines() if not line.startswith(" ")]
    assert heads == ["'France' [12, 18)", "'Alps' [4, 8)"]
    top = api.link([{"text": "the Alps are high", "mentions": [[4, 8]]}], k=2)[0]["mentions"][0]["entities"][0]
    assert f" {top['title']} " in r.stdout.splitlines()[-2]


def test_a_blink_benchmark_file_is_linked_and_scored_as_blink_counts(tiny_run, tiny_reranker, dev_file, tmp_path):
    from dist_nce.eval.blink import blink_scores
    from dist_nce.link import Linker
    from kb.kilt import split_marked_input
    from kb.store import EntityStore

    # the tiny run's dev mentions in BLINK's benchmark layout (create_BLINK_benchmark_data.py's fields), with one
    # gold that is no page of the KB and one that is no integer: BLINK drops both
    lines = []
    for d in (json.loads(x) for x in open(dev_file, encoding="utf-8")):
        left, mention, right = split_marked_input(d["input"], str(dev_file), 0)
        gold = d["output"][0]["provenance"][0]["wikipedia_id"]
        lines.append({"context_left": left, "mention": mention, "context_right": right, "query_id": d["id"],
                      "label_id": gold, "Wikipedia_ID": gold, "Wikipedia_title": d["output"][0]["answer"]})
    lines += [{**lines[0], "query_id": "absent", "label_id": "999999999"},
              {**lines[1], "query_id": "x", "label_id": "x"}]
    src, out, scores = tmp_path / "AIDA-YAGO2_testb.jsonl", tmp_path / "linked.jsonl", tmp_path / "scores.json"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # k = 20 of the 60 entities: the tiny random model's golds are in some lists, not all
    r = run_job("--run", str(tiny_run), "--k", "20", "--reranker", str(tiny_reranker), "--input", str(src),
                "--output", str(out), "--blink-scores", str(scores), "--no-progress")
    assert r.returncode == 0, r.stderr
    got = json.loads(scores.read_text())
    # the same table from the Python API's answers: the retriever's rows and the reranker's top row per mention
    linker = Linker.from_pretrained(tiny_run, k=20, progress=False, reranker=str(tiny_reranker))
    plain = Linker.from_pretrained(tiny_run, k=20, progress=False)
    store = EntityStore(tiny_run.parent / "data" / "prepared")
    gold = list(store.rows_for_source_ids([x["label_id"] for x in lines[:-1]])) + [-1]
    assert gold[-2] == -1 and min(gold[:-2]) >= 0
    ranked = [[e["row"] for e in d["mentions"][0]["entities"]] for d in plain.link(lines)]
    top1 = [d["mentions"][0]["entities"][0]["row"] for d in linker.link(lines)]
    want = blink_scores(ranked, gold, top1)
    assert {k: v for k, v in got.items() if k not in ("input", "reranker")} == json.loads(json.dumps(want))
    assert got["support"] == len(lines) - 2 and 0 < got["recall@20"] < 1
    assert got["table"]["overall unormalized accuracy"] is not None and got["reranker"] == str(tiny_reranker)
    assert f"AIDA-YAGO2_testb.jsonl: biencoder accuracy: {want['table']['biencoder accuracy']:.4f}" in r.stderr
    # every line linked, its BLINK fields kept
    linked = [json.loads(x) for x in out.read_text().splitlines()]
    assert [d["query_id"] for d in linked] == [x["query_id"] for x in lines]
    assert all(d["mentions"][0]["span"] is None and len(d["mentions"][0]["entities"]) == 20 for d in linked)
    # lines that are not BLINK's, or without a gold, are refused before the model loads
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps({k: v for k, v in lines[1].items() if k != "label_id"})
                   + "\n")
    r = run_job("--run", str(tiny_run), "--input", str(bad), "--blink-scores", str(scores))
    assert r.returncode == 2 and f"{bad}:2: --blink-scores needs BLINK mention lines" in r.stderr
    r = run_job("--run", str(tiny_run), "--text", "[a]", "--blink-scores", str(scores))
    assert r.returncode == 2 and "--blink-scores" in r.stderr and "give --input" in r.stderr
