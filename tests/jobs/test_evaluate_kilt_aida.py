"""jobs/evaluate_kilt_aida.py as a user runs it: a subprocess, a real local Ray, 2 shards.

Synthetic KILT + AIDA (golds missing from the KB, one dev line the store skips as
malformed), prepared with kb.prepare; a tiny retriever saved with save_pretrained.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.eval.kilt import kilt_scores, read_jsonl
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from dist_nce.retrieval import build_local_index, retrieve
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_kilt

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "evaluate_kilt_aida.py"
K, KS = 16, [1, 5, 16]
BAD_DEV_LINE = 4  # its input loses [START_ENT]/[END_ENT]: kb skips it, KILT still scores it


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("eval_kilt_aida")
    src = write_kilt(root / "src", 90, 0, 24, 10, seed=5, missing_gold=0.15)
    lines = src["dev"].read_text().splitlines()
    rec = json.loads(lines[BAD_DEV_LINE - 1])
    rec["input"] = rec["input"].replace("[START_ENT] ", "").replace(" [END_ENT]", "")
    lines[BAD_DEV_LINE - 1] = json.dumps(rec)
    src["dev"].write_text("\n".join(lines) + "\n")
    prepare(PrepareConfig(out=str(root / "kb"), kilt_ks=str(src["kb"]), aida_dir=str(root / "src"),
                          model_dir=tiny_model_dir, entity_max_len=48, mention_max_len=32, on_bad_record="skip",
                          progress=False), log=lambda _: None)
    torch.manual_seed(0)
    r = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir, storage_dtype="float32"))
    with torch.no_grad():  # spread a random tiny BERT's near-identical outputs (see tests/eval)
        for p in r.parameters():
            p.add_(0.5 * torch.randn_like(p))
    r.save_pretrained(root / "model")
    return root, src


def run_job(root: Path, out: str, *extra: str, address: str | None = None) -> subprocess.CompletedProcess:
    """The job in its own process; with ``address`` it joins that Ray (RAY_ADDRESS, as under ``ray job
    submit``) instead of starting one."""
    cmd = [sys.executable, str(JOB), "--model", str(root / "model"), "--store", str(root / "kb"),
           "--out", str(root / out), "--k", str(K), "--ks", ",".join(map(str, KS)), "--no-progress",
           "--set", "num_shards=2", "--set", "num_cpus=0.5", "--set", "encode_dtype=fp32", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, **({"RAY_ADDRESS": address} if address else {})})


@pytest.mark.slow
@pytest.mark.ray
def test_job_end_to_end_and_snapshot_reuse(ray_local, setup):
    root, src = setup
    r = run_job(root, "eval", address=ray_local)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "index version 0: encoded" in r.stdout
    out = root / "eval"
    report = json.loads((out / "scores.json").read_text())
    assert json.loads((out / "manifest.json").read_text())["kind"] == "kilt_aida_eval"

    # One guess line per id of the ORIGINAL files, in their order; test gets a guess file only.
    for split in ("dev", "test"):
        gold_ids = [g["id"] for g in read_jsonl(src[split])]
        guesses = read_jsonl(out / f"{split}_guess.jsonl")
        assert [g["id"] for g in guesses] == gold_ids
        assert all(len(g["output"][0]["provenance"]) == K for i, g in enumerate(guesses)
                   if not (split == "dev" and i == BAD_DEV_LINE - 1))
    dev = report["splits"]["dev"]
    skipped = read_jsonl(out / "dev_guess.jsonl")[BAD_DEV_LINE - 1]["output"][0]
    assert skipped == {"answer": "", "provenance": []} and dev["n_ids_not_in_store"] == 1
    store = EntityStore(root / "kb")
    mentions = MentionTable(root / "kb", "dev")
    assert dev["n_gold_not_in_kb"] == mentions.manifest["mentions"]["dev"]["gold"]["missing"] > 0
    assert "kilt" not in report["splits"]["test"]

    # The numbers: KILT's scores of the written files, printed in the table.
    want = kilt_scores(src["dev"], out / "dev_guess.jsonl", KS)
    assert dev["kilt"] == want
    row = next(line for line in r.stdout.splitlines() if line.startswith("dev "))
    values = [want["downstream"]["accuracy"], want["kilt"]["KILT-accuracy"], want["retrieval"]["Rprec"],
              want["retrieval"]["precision@1"]] + [want["retrieval"][f"recall@{k}"] for k in KS[1:]]
    assert row.split()[3:] == [f"{v:.4f}" for v in values]
    assert want["retrieval"]["recall@16"] > want["retrieval"]["precision@1"]  # a non-trivial ranking

    # Shards' top k == an in-process index over the same model (itself tested against brute force).
    model = Retriever.from_pretrained(root / "model")
    local = retrieve(model, mentions, build_local_index(model, store, progress=False), K, progress=False)
    by_id = {g["id"]: g for g in read_jsonl(out / "dev_guess.jsonl")}
    for i, mid in enumerate(mentions.mention_ids):
        got = [p["wikipedia_id"] for p in by_id[mid]["output"][0]["provenance"]]
        assert got == store.source_ids(local.rows[i])
        assert by_id[mid]["output"][0]["answer"] == store.titles([local.rows[i, 0]])[0]
    assert np.all(local.rows >= 0)

    # A second run over the same snapshot directory reloads the embeddings, encodes nothing.
    r2 = run_job(root, "eval2", "--snapshot-dir", str(out / "snapshot"), "--splits", "dev", address=ray_local)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "index version 0: reused the persisted snapshot" in r2.stdout
    assert (root / "eval2" / "dev_guess.jsonl").read_bytes() == (out / "dev_guess.jsonl").read_bytes()


def test_job_refuses_a_store_of_another_tokenizer(setup, tmp_path):
    root, _ = setup
    manifest = json.loads((root / "kb" / "manifest.json").read_text())
    fake = tmp_path / "kb"
    fake.mkdir()
    (fake / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "0" * 64}))
    cmd = [sys.executable, str(JOB), "--model", str(root / "model"), "--store", str(fake), "--out",
           str(tmp_path / "o"), "--searcher", "local"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tokenizer_sha256" in r.stderr and "re-run jobs/prepare_kb.py" in r.stderr


def edited_dev(root, src, tmp_path, line: int, edit) -> tuple:
    """(AIDA dir, dev file, record): a copy of the job's AIDA files whose dev line ``line`` (0-based) is
    ``edit(record, lines)``-ed in place."""
    aida = tmp_path / "aida"
    shutil.copytree(root / "src", aida)
    dev = aida / src["dev"].name
    lines = dev.read_text().splitlines()
    rec = json.loads(lines[line])
    edit(rec, lines)
    lines[line] = json.dumps(rec)
    dev.write_text("\n".join(lines) + "\n")
    return aida, dev, rec


def test_a_repeated_gold_id_is_refused_before_retrieval(setup, tmp_path):
    """A gold file changed after prepare (or another --aida-dir) with an id twice: the error names the gold
    file and both lines, before any retrieval, and writes nothing (it used to name a guess file never written)."""
    root, src = setup
    aida, dev, rec = edited_dev(root, src, tmp_path, 6, lambda rec, lines: rec.update(id=json.loads(lines[1])["id"]))
    cmd = [sys.executable, str(JOB), "--model", str(root / "model"), "--store", str(root / "kb"), "--out",
           str(tmp_path / "o"), "--aida-dir", str(aida), "--searcher", "local", "--splits", "dev", "--no-progress"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{dev}:7: duplicate id {rec['id']!r} (first at line 2)" in r.stderr
    assert "retrieve" not in r.stdout + r.stderr and not (tmp_path / "o").exists()


def test_a_gold_record_kilt_cannot_score_is_refused_before_retrieval(setup, tmp_path, capsys):
    """A provenance title that is not a string (KILT's scorer crashes on it; ours raised AttributeError
    after the whole retrieval): one line naming the file, line and id, before any retrieval. In-process:
    the subprocess path is the test above."""
    from dist_nce.cli.evaluate_kilt_aida import main

    root, src = setup
    aida, dev, rec = edited_dev(root, src, tmp_path, 3,
                                lambda rec, lines: rec["output"][0]["provenance"][0].update(title=5))
    code = main(["--model", str(root / "model"), "--store", str(root / "kb"), "--out", str(tmp_path / "o"),
                 "--aida-dir", str(aida), "--searcher", "local", "--splits", "dev", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and err.endswith(f"\nerror: {dev}:4 (id {rec['id']!r}): gold provenance 'title' must be a "
                                      "string\n") and "Traceback" not in err, err
    assert "retrieve" not in out and not (tmp_path / "o").exists()


def test_a_blink_biencoder_file_evaluates_like_its_imported_retriever(setup):
    """--model takes BLINK's released biencoder layout (tiny here); local searcher: no Ray."""
    from dist_nce.modeling.resolve import load_retriever
    from tests.blink_helpers import write_blink_biencoder

    root, _ = setup
    bi = write_blink_biencoder(root / "blink" / "biencoder_wiki_large.bin")
    out = root / "eval_blink"
    cmd = [sys.executable, str(JOB), "--model", str(bi), "--store", str(root / "kb"), "--out", str(out),
           "--k", str(K), "--ks", ",".join(map(str, KS)), "--no-progress", "--searcher", "local", "--splits", "dev"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "scores.json").read_text())["model"] == str(bi.resolve())
    model = load_retriever(bi).eval()
    store, mentions = EntityStore(root / "kb"), MentionTable(root / "kb", "dev")
    local = retrieve(model, mentions, build_local_index(model, store, progress=False), K, progress=False)
    by_id = {g["id"]: g for g in read_jsonl(out / "dev_guess.jsonl")}
    for i, mid in enumerate(mentions.mention_ids):
        assert [p["wikipedia_id"] for p in by_id[mid]["output"][0]["provenance"]] == store.source_ids(local.rows[i])
    bad = subprocess.run(cmd[:3] + [str(root / "blink")] + cmd[4:], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "a directory without manifest.json; expected a dist-nce retriever" in bad.stderr
