import json

import pytest

from dist_nce.core.artifacts import ArtifactMismatch, atomic_path, atomic_write_json, read_manifest, write_manifest


def test_manifest_roundtrip_and_mismatch(tmp_path):
    write_manifest(tmp_path, kind="kb", schema_version=1, tokenizer="abc")
    m = read_manifest(tmp_path, kind="kb", schema_version=1, expect={"tokenizer": "abc"})
    assert m["tokenizer"] == "abc"
    with pytest.raises(ArtifactMismatch, match=r"manifest.json: field 'tokenizer' is 'abc', expected 'xyz'"):
        read_manifest(tmp_path, expect={"tokenizer": "xyz"})
    with pytest.raises(ArtifactMismatch, match="no manifest"):
        read_manifest(tmp_path / "nope")


def test_atomic_write_leaves_old_file_on_error(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
