"""Linking with no run: BLINK's released files (tiny ones in their layout) over a prepared store.

The KB index comes from encoding in process, from a snapshot exported elsewhere (encode_kb's
layout, recognised by the entity encoder's fingerprint), or from the service's shards reusing
the versions jobs/encode_kb.py persisted (the one Ray test, which runs that job first).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.core.text import special_ids
from dist_nce.index.encode import encode_rows, state_fingerprint, store_fingerprint
from dist_nce.index.export import export_snapshot
from dist_nce.index.versions import PersistedVersions, shard_dir_name
from dist_nce.link import Linker
from dist_nce.link.linker import _TokenRows
from dist_nce.modeling.reranker import build_blink_pairs
from dist_nce.modeling.resolve import load_reranker, load_retriever
from dist_nce.retrieval import build_local_index, retrieve
from kb.store import EntityStore
from tests.link.test_serve import assert_same_ranking

REPO = Path(__file__).resolve().parents[2]


def docs_of(dev_file, n=None) -> list[dict]:
    return [json.loads(line) for line in open(dev_file, encoding="utf-8")][:n]


def rows(linked: list[dict]) -> list:
    return [[[e["row"] for e in m["entities"]] for m in d["mentions"]] for d in linked]


def write_snapshot(out: Path, model, store_dir: Path) -> Path:
    """What jobs/encode_kb.py leaves in --out for ``model`` (one shard), without Ray."""
    retriever = load_retriever(model).eval()
    store = EntityStore(store_dir)
    n = store.num_entities
    fingerprint = state_fingerprint(retriever.entity_encoder_state())
    reps = encode_rows(retriever.entity_side, store, 64, torch.device("cpu"), None, retriever.config.storage_dtype)
    versions = PersistedVersions(out / "shards" / shard_dir_name(0, 1),
                                 {"rows": [0, n], "store_fingerprint": store_fingerprint(str(store_dir))})
    versions.save(0, reps, encoder_fingerprint=fingerprint)
    export_snapshot(out, store, [((0, n), versions.path(0))], version=0, model=str(model),
                    encoder_fingerprint=fingerprint)
    return out


@pytest.fixture(scope="module")
def encoded(blink_files, tiny_store):
    bi, cross = blink_files
    return Linker.from_pretrained(model=str(bi), store=str(tiny_store), kb="encode", k=4, progress=False,
                                  reranker=str(cross), rerank_pairs=6)


def test_blink_files_link_with_exact_rankings_and_blink_reranker_scores(encoded, blink_files, tiny_store, dev_file):
    bi, cross = blink_files
    docs = docs_of(dev_file)
    got = encoded.link(docs)
    retriever = load_retriever(bi).eval()
    store = EntityStore(tiny_store)
    prepared = encoded.prepare(docs)
    want = retrieve(retriever, _TokenRows(prepared.ids, prepared.lengths),
                    build_local_index(retriever, store, progress=False), 4, progress=False)
    reranker = load_reranker(cross).eval()
    assert encoded.reranker.config.layout == "blink"  # BLINK's input: the mention part padded to 32 tokens
    with torch.no_grad():
        pairs = build_blink_pairs(prepared.ids, store.token_ids(want.rows), special_ids(reranker.tokenizer),
                                  max_len=256, context_len=32, cand_len=128)
        scores = reranker(pairs).numpy()
    for i, d in enumerate(got):
        ents = d["mentions"][0]["entities"]
        assert sorted(e["row"] for e in ents) == sorted(want.rows[i].tolist())
        by_row = dict(zip(want.rows[i].tolist(), scores[i].tolist()))
        np.testing.assert_allclose([e["rerank_score"] for e in ents], [by_row[e["row"]] for e in ents], atol=1e-5)
        assert [e["rerank_score"] for e in ents] == sorted((e["rerank_score"] for e in ents), reverse=True)


def test_a_snapshot_exported_elsewhere_is_reused_only_for_these_weights(encoded, blink_files, tiny_store, tiny_run,
                                                                        dev_file, tmp_path):
    bi, _ = blink_files
    snap = write_snapshot(tmp_path / "emb", bi, tiny_store)
    docs = docs_of(dev_file)
    linker = Linker.from_pretrained(model=str(bi), store=str(tiny_store), snapshot=str(snap), k=4, progress=False)
    assert_same_ranking(linker.link(docs), Linker.from_pretrained(
        model=str(bi), store=str(tiny_store), kb="encode", k=4, progress=False).link(docs), atol=1e-3)
    # the tiny run's own snapshot was made by other weights: refused, never searched
    with pytest.raises(ArtifactMismatch, match="other entity-encoder weights"):
        Linker.from_pretrained(model=str(bi), store=str(tiny_store), snapshot=str(tiny_run / "kb_snapshot"),
                               progress=False)
    # and this one is refused for the run's model
    with pytest.raises(ArtifactMismatch, match="other entity-encoder weights"):
        Linker.from_pretrained(tiny_run, snapshot=str(snap), progress=False)


def test_what_is_missing_is_named(blink_files, tiny_store, tiny_run, tmp_path):
    bi, cross = blink_files
    with pytest.raises(FileNotFoundError, match="needs the prepared store"):
        Linker.from_pretrained(model=str(bi))
    with pytest.raises(FileNotFoundError, match="no KB snapshot to search; give snapshot"):
        Linker.from_pretrained(model=str(bi), store=str(tiny_store), progress=False)
    with pytest.raises(ValueError, match="not both"):
        Linker.from_pretrained(tiny_run, model=str(bi))
    with pytest.raises(FileNotFoundError, match="nothing to link with"):
        Linker.from_pretrained()
    with pytest.raises(FileNotFoundError, match="no exported KB snapshot"):
        Linker.from_pretrained(model=str(bi), store=str(tiny_store), snapshot=str(tmp_path))
    with pytest.raises(ValueError, match="looks like a BLINK cross-encoder"):
        Linker.from_pretrained(model=str(cross), store=str(tiny_store), kb="encode")
    with pytest.raises(FileNotFoundError, match="service with model .* needs service.shard_dir"):
        Linker.from_pretrained(model=str(bi), store=str(tiny_store), searcher="service")


def test_the_job_links_with_blink_files(encoded, blink_files, tiny_store):
    bi, cross = blink_files
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "jobs/link.py", "--model", str(bi), "--store", str(tiny_store), "--kb",
                        "encode", "--reranker", str(cross), "--k", "4", "--no-progress",
                        "--text", "Tulsa lies in [Oklahoma] ."], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    want = encoded.link([{"text": "Tulsa lies in Oklahoma .", "mentions": [[14, 22]]}])[0]["mentions"][0]
    lines = r.stdout.splitlines()
    assert lines[0] == "'Oklahoma' [14, 22)"
    for rank, (line, e) in enumerate(zip(lines[1:], want["entities"]), 1):
        assert line.split()[0] == f"{rank}." and f"id {e['id']} " in line and "rerank" in line
    r = subprocess.run([sys.executable, "jobs/link.py", "--store", str(tiny_store), "--text", "[a]"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "give --run (a run directory) or --model" in r.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_encode_kb_then_link_reuses_its_shards_and_snapshot(ray_local, blink_files, tiny_store, dev_file, tmp_path):
    """jobs/encode_kb.py with the BLINK file; the service's shards reload its persisted versions
    (nothing re-encoded) and its export serves the local searcher: the same rankings as encoding."""
    bi, _ = blink_files
    out = tmp_path / "emb"
    r = subprocess.run([sys.executable, "jobs/encode_kb.py", "--prepared", str(tiny_store), "--model", str(bi),
                        "--out", str(out), "--num-shards", "2", "--num-cpus", "0.25", "--encode-dtype", "fp32",
                        "--no-progress"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "RAY_ADDRESS": ray_local})
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    fingerprint = state_fingerprint(load_retriever(bi).entity_encoder_state())
    assert manifest["encoder_fingerprint"] == fingerprint and manifest["shape"][1:] == [64]

    docs = docs_of(dev_file)
    want = Linker.from_pretrained(model=str(bi), store=str(tiny_store), kb="encode", k=4, progress=False).link(docs)
    local = Linker.from_pretrained(model=str(bi), store=str(tiny_store), snapshot=str(out), k=4, progress=False)
    assert_same_ranking(local.link(docs), want, atol=1e-3)
    service = {"num_shards": 2, "num_cpus": 0.25, "shard_dir": str(out / "shards"), "encode_dtype": "fp32"}
    with Linker.from_pretrained(model=str(bi), store=str(tiny_store), searcher="service", service=service, k=4,
                                progress=False) as linker:
        status = linker.searcher.status()
        assert [s["source"] for s in status] == ["reloaded", "reloaded"], status
        assert all(s["encoder_fingerprint"] == fingerprint for s in status)
        assert_same_ranking(linker.link(docs), want, atol=1e-3)
