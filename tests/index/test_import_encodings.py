"""index.import_encodings: a precomputed matrix becomes the version 0 a shard would have encoded (no Ray)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.shard import EntityShard
from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.index.config import IndexConfig
from dist_nce.index.encode import encode_rows, state_fingerprint, store_fingerprint
from dist_nce.index.import_encodings import AlignmentError, ImportTarget, align_rows, import_matrix, read_row_ids
from dist_nce.index.matrix_file import open_matrix
from dist_nce.index.versions import PersistedVersions, write_vecs_streamed
from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig
from dist_nce.modeling.scoring import Reps, ScoreSpec
from kb.store import EntityStore

from tests.actors.test_shard import D, N, entity_state, store_dir  # noqa: F401  (store_dir is a fixture)

SPLIT = [(0, 45), (45, N)]
CONFIG = ServiceConfig(encode_dtype="fp32", index=IndexConfig(backend="torch"))


@pytest.fixture(scope="module")
def state(tiny_model_dir):
    return entity_state(tiny_model_dir, noise=0.05, seed=3)


@pytest.fixture(scope="module")
def encodings(store_dir, state, tmp_path_factory):
    """The store's fp32 entity encodings, as BLINK writes them: a legacy-format torch.save.

    Encoded shard by shard in the shards' own batches: fp32 matmuls round differently with the
    batch's shape on some CPUs (AVX512 kernels), and the first test compares bytes."""
    encoder = EntityEncoder.from_state(state).eval()
    store = EntityStore(store_dir)
    vecs = torch.cat([encode_rows(encoder, store.slice(a, b), CONFIG.encode_batch_size, torch.device("cpu"), None,
                                  "float32").vecs for a, b in SPLIT])
    path = tmp_path_factory.mktemp("enc") / "all_entities.t7"
    torch.save(vecs, path, _use_new_zipfile_serialization=False)
    return path, vecs


def target(root, store_dir, state, storage_dtype="float16"):
    return ImportTarget(root, SPLIT, store_fingerprint(store_dir), dataclasses.asdict(ScoreSpec.preset("dual")),
                        storage_dtype, state_fingerprint(state))


def test_an_imported_version_is_what_the_shard_encodes_and_is_served_as_is(store_dir, state, encodings, tmp_path):
    path, _ = encodings
    manifests = import_matrix(open_matrix(path), None, target(tmp_path / "imported", store_dir, state),
                              chunk_rows=7, encode_dtype="imported")
    assert [m["rows"] for m in manifests] == [list(r) for r in SPLIT]
    retriever = RetrieverConfig(preset="dual", storage_dtype="float16")
    for i, rows in enumerate(SPLIT):
        imported = EntityShard(store_dir, rows, i, len(SPLIT), retriever, CONFIG, str(tmp_path / "imported"), D)
        status = imported.status()
        assert status["served"] == 0 and status["source"] == "reloaded"
        assert status["encoder_fingerprint"] == state_fingerprint(state)
        # the shard's own encode of the same weights: the same bytes on disk
        own = EntityShard(store_dir, rows, i, len(SPLIT), retriever, CONFIG, str(tmp_path / "own"), D)
        own.refresh(state, 0)
        a, b = (load_file(str(s.versions.path(0) / "embeddings.safetensors"))["vecs"] for s in (imported, own))
        assert a.dtype == torch.float16 and torch.equal(a, b)
        # and a refresh to version 0 with those weights finds it done: no encode
        assert imported.refresh(state, 0) == 0 and imported.status()["encodes"] == 0


def test_rows_are_matched_by_id_and_mismatches_are_named(store_dir, state, encodings, tmp_path):
    path, vecs = encodings
    store = EntityStore(store_dir)
    ids = [str(s) for s in store.source_ids(np.arange(N))]
    perm = np.random.default_rng(0).permutation(N)
    shuffled = tmp_path / "shuffled.npy"
    np.save(shuffled, vecs[perm].numpy())
    (tmp_path / "ids.txt").write_text("\n".join(ids[p] for p in perm) + "\n")
    matrix = open_matrix(shuffled)
    row_of = align_rows(matrix, store, read_row_ids(tmp_path / "ids.txt"))
    assert np.array_equal(perm[row_of], np.arange(N))
    import_matrix(matrix, row_of, target(tmp_path / "by_id", store_dir, state, "float32"), chunk_rows=5)
    got = torch.cat([PersistedVersions(tmp_path / "by_id" / d, {}).load(0)[0].vecs
                     for d in ("shard-000-of-002", "shard-001-of-002")])
    assert torch.equal(got, vecs)
    assert align_rows(open_matrix(path), store, ids) is None  # ids in store order: no mapping needed

    extra = open_matrix(shuffled)
    with pytest.raises(AlignmentError, match=r"1 store entities have no row .* row 7 \(id 1007\)"):
        align_rows(extra, store, [i if i != "1007" else "99999" for i in (ids[p] for p in perm)])
    twice = [i if i != "1004" else "1003" for i in (ids[p] for p in perm)]
    a, b = [k for k, i in enumerate(twice) if i == "1003"]
    with pytest.raises(AlignmentError, match=rf"id 1003 names matrix rows {a} and {b} \(counting from 0: its ids "
                                             rf"number {a + 1} and {b + 1}\)"):
        align_rows(extra, store, twice)
    with pytest.raises(AlignmentError, match=rf"id 'x3' names matrix rows {a} and {b} \(counting from 0"):
        align_rows(extra, store, [f"x{i[-1]}" if i == "1003" else f"y{i}" for i in twice])  # ids that are not numbers
    with pytest.raises(AlignmentError, match=f"{N - 1} ids for the {N} rows"):
        align_rows(extra, store, ids[1:])
    np.save(tmp_path / "short.npy", vecs[:-1].numpy())
    with pytest.raises(AlignmentError, match=f"{N - 1} rows, but the store has {N}"):
        align_rows(open_matrix(tmp_path / "short.npy"), store, None)


def test_blink_entity_jsonl_gives_the_ids_and_a_bad_line_is_named(tmp_path):
    lines = [{"text": " a ", "idx": f"https://en.wikipedia.org/wiki?curid={i}", "title": f"T{i}", "entity": f"T{i}"}
             for i in (12, 7, 1000)]
    path = tmp_path / "entity.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_row_ids(path) == ["12", "7", "1000"]
    # opened by a byte order mark (prepare reads such a file; the ids must read the same, the first included)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_row_ids(path) == ["12", "7", "1000"]
    (tmp_path / "ids.txt").write_bytes(b"\xef\xbb\xbf12\n7\n")
    assert read_row_ids(tmp_path / "ids.txt") == ["12", "7"]
    path.write_text(json.dumps(lines[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match="entity.jsonl.*2"):
        read_row_ids(path)


def test_a_rerun_keeps_finished_shards_and_refuses_another_encoders(store_dir, state, encodings, tmp_path):
    path, _ = encodings
    t = target(tmp_path / "imp", store_dir, state)
    import_matrix(open_matrix(path), None, t)
    file = tmp_path / "imp" / "shard-001-of-002" / "v00000000" / "embeddings.safetensors"
    before = file.stat().st_mtime_ns
    seen = []
    import_matrix(open_matrix(path), None, t, progress=seen.append)
    assert file.stat().st_mtime_ns == before and sum(seen) == N
    other = dataclasses.replace(t, encoder_fingerprint="another")
    with pytest.raises(FileExistsError, match="v00000000 holds version 0 of another encoder"):
        import_matrix(open_matrix(path), None, other)


def test_streamed_safetensors_equal_a_plain_save_and_check_their_rows(tmp_path):
    x = torch.randn(10, 4).bfloat16()
    write_vecs_streamed(tmp_path / "a.safetensors", [10, 4], torch.bfloat16, [x[:3], x[3:9], x[9:]])
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["vecs"], x)
    with pytest.raises(ValueError, match="held 9 rows, 10 announced"):
        write_vecs_streamed(tmp_path / "b.safetensors", [10, 4], torch.bfloat16, [x[:9]])
    with pytest.raises(ValueError, match="more than the 10 rows"):
        write_vecs_streamed(tmp_path / "c.safetensors", [10, 4], torch.bfloat16, [x, x[:1]])
    with pytest.raises(ValueError, match="expected CPU torch.bfloat16"):
        write_vecs_streamed(tmp_path / "d.safetensors", [10, 4], torch.bfloat16, [x.float()])


# A real import in a child process, slowed to a row per 50 ms so the parent can act mid-write.
SLOW_IMPORT = """
import json, sys, time
from pathlib import Path
from dist_nce.index.import_encodings import ImportTarget, import_matrix
from dist_nce.index.matrix_file import open_matrix
a = json.loads(sys.argv[1])
t = ImportTarget(Path(a["root"]), [tuple(r) for r in a["ranges"]], a["store"], a["spec"], a["dtype"], a["fp"])
import_matrix(open_matrix(a["matrix"]), None, t, chunk_rows=1, progress=lambda n: time.sleep(0.05),
              encode_dtype="imported")
"""


def _temps(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


def test_a_killed_import_leaves_nothing_once_rerun_and_a_live_writer_is_left_alone(store_dir, state, encodings,
                                                                                     tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    path, _ = encodings
    t = target(tmp_path / "killed", store_dir, state)
    args = {"root": str(t.shard_root), "ranges": t.ranges, "store": t.store_fingerprint, "spec": t.spec,
            "dtype": t.storage_dtype, "fp": t.encoder_fingerprint, "matrix": str(path)}
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, json.dumps(args)], cwd=repo,
                             env={**os.environ, "PYTHONPATH": str(repo)}, stderr=subprocess.PIPE, text=True)
    shard0 = t.shard_root / "shard-000-of-002"
    try:
        deadline = time.monotonic() + 120
        while not list(shard0.glob(".v00000000.*.tmp")):
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.02)
        # a live writer's temporary: another writer's sweep leaves it alone
        versions = PersistedVersions(shard0, {})
        assert versions.sweep_temps() == [] and len(list(shard0.glob(".v00000000.*.tmp"))) == 1
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    left = _temps(t.shard_root)
    assert len(left) == 1 and left[0].startswith("shard-000-of-002/.v00000000."), left  # what a kill leaves

    manifests = import_matrix(open_matrix(path), None, t, chunk_rows=5, encode_dtype="imported")
    assert _temps(t.shard_root) == []
    clean = import_matrix(open_matrix(path), None, target(tmp_path / "clean", store_dir, state), chunk_rows=5,
                          encode_dtype="imported")
    drop = {"created_utc"}
    assert [{k: v for k, v in m.items() if k not in drop} for m in manifests] == \
        [{k: v for k, v in m.items() if k not in drop} for m in clean]
    for shard in ("shard-000-of-002", "shard-001-of-002"):
        file = f"{shard}/v00000000/embeddings.safetensors"
        assert (t.shard_root / file).read_bytes() == (tmp_path / "clean" / file).read_bytes()


def test_sweep_removes_only_dead_version_temporaries(tmp_path):
    """Only atomic_path's temporaries of version directories, and only with no writer alive."""
    import fcntl
    import os

    versions = PersistedVersions(tmp_path / "shard", {"rows": [0, 3]})
    versions.save(0, Reps(torch.zeros(3, 2), None))
    d = tmp_path / "shard"
    (d / ".v00000001.abc123.tmp").mkdir()
    (d / ".v00000001.abc123.tmp" / "embeddings.safetensors").write_bytes(b"x" * 10)
    (d / ".v00000002.zz.tmp").write_bytes(b"a file temporary")
    for other in (".v00000001.old", "notes.tmp", ".manifest.json.q.tmp", "v00000009"):
        (d / other).mkdir()
    fd = os.open(d / ".writers.lock", os.O_RDWR)  # a writer alive in the directory
    fcntl.flock(fd, fcntl.LOCK_SH)
    assert versions.sweep_temps() == []
    os.close(fd)
    assert versions.sweep_temps() == [".v00000001.abc123.tmp", ".v00000002.zz.tmp"]
    assert sorted(p.name for p in d.iterdir()) == [".manifest.json.q.tmp", ".v00000001.old", ".writers.lock",
                                                   "notes.tmp", "v00000000", "v00000009"]
    assert versions.valid_versions() == [0]


def test_the_ceiling_holds_while_newer_versions_are_on_disk(tmp_path):
    """PersistedVersions.mark_served: a ceiling only while a version above the one served is on disk; an
    unreadable one names its file."""
    versions = PersistedVersions(tmp_path / "shard", {"rows": [0, 3]})
    for v in range(3):
        versions.save(v, Reps(torch.zeros(3, 2), None))
    assert versions.ceiling() is None
    versions.mark_served(0)  # gone back below 1 and 2
    assert versions.ceiling() == 0 and json.loads((tmp_path / "shard" / "serving.json").read_text()) == {"ceiling": 0}
    versions.mark_served(1)
    assert versions.ceiling() == 1
    versions.mark_served(2)  # nothing above: no ceiling
    assert versions.ceiling() is None and not (tmp_path / "shard" / "serving.json").exists()
    (tmp_path / "shard" / "serving.json").write_text('{"ceiling": "1"}')
    with pytest.raises(ArtifactMismatch, match=r"serving\.json: 'ceiling' must be an integer"):
        versions.ceiling()
    (tmp_path / "shard" / "serving.json").write_text("{")
    with pytest.raises(ArtifactMismatch, match=r"serving\.json: unreadable .*remove it"):
        versions.ceiling()
    versions.mark_served(0)  # serving is what it knows: an unreadable file is written over, not an error
    assert versions.ceiling() == 0
