"""kb.prepare --overwrite: the replacement is built beside the old store and swapped in
only when complete, so a failed re-prepare leaves the old store byte for byte."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import kb.staging as staging
from dist_nce.core.records import BadRecord
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore
from tests.kb.test_prepare import kilt_line, write_kilt

QUIET = {"log": lambda s: None}


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def old_store(tmp_path, minilm_dir):
    write_kilt(tmp_path / "old.json", 30, seed=1)
    c = PrepareConfig(out=str(tmp_path / "kb"), kilt_ks=str(tmp_path / "old.json"), model_dir=minilm_dir,
                      chunk_size="1K", rows_per_part=8, progress=False)
    prepare(c, **QUIET)
    return tmp_path / "kb", tree_hashes(tmp_path / "kb")


def _replace(tmp_path: Path, minilm_dir: str, source: Path, **kw) -> dict:
    return prepare(PrepareConfig(out=str(tmp_path / "kb"), kilt_ks=str(source), model_dir=minilm_dir, chunk_size="1K",
                                 rows_per_part=8, overwrite=True, progress=False, **kw), **QUIET)


def test_a_bad_line_leaves_the_old_store_byte_identical(tmp_path, minilm_dir, old_store):
    out, before = old_store
    write_kilt(tmp_path / "new.json", 40, seed=2, replace={33: '{"wikipedia_id": "133"'})
    with pytest.raises(BadRecord, match=r"new.json:33: not JSON"):
        _replace(tmp_path, minilm_dir, tmp_path / "new.json")
    assert tree_hashes(out) == before
    assert EntityStore(out).num_entities == 30


def test_a_duplicate_found_at_assembly_leaves_the_old_store_byte_identical(tmp_path, minilm_dir, old_store):
    out, before = old_store
    # Lines 4 and 38 share an id; they lie in different 1K chunks, so every chunk parses
    # and the duplicate is found only when the chunks are assembled.
    write_kilt(tmp_path / "new.json", 40, seed=2, replace={38: kilt_line(103, "Copy of three", "dup")})
    with pytest.raises(BadRecord, match=r"new.json:38: duplicate source id '103' \(first at line 4\)"):
        _replace(tmp_path, minilm_dir, tmp_path / "new.json")
    new = staging.staging_dir(out)
    markers = list((new / "chunks").glob("entities-*.json"))
    assert len(markers) > 2, "the failure must come after every chunk was ingested"
    assert tree_hashes(out) == before
    assert EntityStore(out).num_entities == 30


def test_a_complete_replacement_is_swapped_in_and_nothing_is_left_beside_it(tmp_path, minilm_dir, old_store):
    out, _ = old_store
    write_kilt(tmp_path / "new.json", 40, seed=2)
    m = _replace(tmp_path, minilm_dir, tmp_path / "new.json")
    assert m["entities"]["count"] == 40 and EntityStore(out).num_entities == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb", "new.json", "old.json"]
    assert not (out / "chunks").exists()


def test_a_swap_killed_between_its_renames_is_finished_by_the_next_run(tmp_path, minilm_dir, old_store, monkeypatch):
    out, _ = old_store
    write_kilt(tmp_path / "new.json", 40, seed=2)
    real_replace = os.replace

    def replace_then_die(src, dst):
        if Path(src) == staging.staging_dir(out):
            raise KeyboardInterrupt  # killed after the old store moved aside, before the new one moved in
        real_replace(src, dst)

    monkeypatch.setattr(staging.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        _replace(tmp_path, minilm_dir, tmp_path / "new.json")
    monkeypatch.setattr(staging.os, "replace", real_replace)
    assert not out.exists() and staging.retired_dir(out).is_dir() and staging.staging_dir(out).is_dir()
    logs = []
    m = prepare(PrepareConfig(out=str(out), kilt_ks=str(tmp_path / "new.json"), model_dir=minilm_dir,
                              chunk_size="1K", rows_per_part=8, progress=False), log=logs.append)
    assert any("finished replacing" in line for line in logs)
    assert m["entities"]["count"] == 40 and not staging.retired_dir(out).exists()


def test_recover_restores_the_old_store_when_the_new_one_is_incomplete(tmp_path):
    out = tmp_path / "kb"
    old, new = staging.retired_dir(out), staging.staging_dir(out)
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    new.mkdir()  # no manifest: not complete
    staging.recover(out, log=lambda s: None)
    assert (out / "manifest.json").read_text() == "{}" and not old.exists() and new.exists()


def test_manifest_paths_are_absolute(tmp_path, minilm_dir, monkeypatch):
    write_kilt(tmp_path / "ks.json", 12)
    aida = tmp_path / "aida"
    aida.mkdir()
    (aida / "aidayago2-train-kilt.jsonl").write_text(json.dumps({
        "id": "m", "input": "a [START_ENT] b [END_ENT] c",
        "output": [{"answer": "x", "provenance": [{"wikipedia_id": "101"}]}]}) + "\n")
    monkeypatch.chdir(tmp_path)
    m = prepare(PrepareConfig(out="kb", kilt_ks="ks.json", aida_dir="aida", model_dir=minilm_dir, progress=False),
                **QUIET)
    paths = [*m["source"]["entity_files"], m["source"]["aida_dir"], *[f["path"] for f in m["source"]["files"]],
             *[f["path"] for f in m["entities"]["files"]], m["mentions"]["train"]["source"]]
    assert paths and all(os.path.isabs(p) for p in paths), paths
    assert m["source"]["aida_dir"] == str(aida.resolve())
