"""jobs/encode_kb.py run as a user runs it: a subprocess of the project's Python.

The job joins this test's local Ray through RAY_ADDRESS, exactly as under
``ray job submit`` (which sets it for the entrypoint). Covers the export layout, the
resume of a partial run (one shard's persisted version missing: only that shard
encodes) and the refusal of an --out made with another model/preset (in-process: it
happens before Ray starts).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dist_nce.cli.encode_kb as job
from dist_nce.core.run_lock import LOCK_FILE, RunDirBusy, acquire
from kb.prepare import PrepareConfig, prepare

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "encode_kb.py"
N = 80
WORDS = "river north castle album band film league station county party war song".split()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_model_dir) -> str:
    root = tmp_path_factory.mktemp("encode_kb")
    rng = random.Random(5)
    lines = []
    for i in range(N):
        title = f"{rng.choice(WORDS).title()} {i}"
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))
        lines.append(json.dumps({"_id": str(i), "wikipedia_id": str(700 + i), "wikipedia_title": title,
                                 "text": [title + "\n", body + "\n"], "anchors": [], "categories": "",
                                 "history": {}}))
    (root / "ks.json").write_text("\n".join(lines) + "\n")
    prepare(PrepareConfig(out=str(root / "store"), kilt_ks=str(root / "ks.json"), model_dir=tiny_model_dir,
                          entity_max_len=24, progress=False), log=lambda s: None)
    return str(root / "store")


def encode_kb(args: list[str], address: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"RAY_ADDRESS": address} if address else {})}
    return subprocess.run([sys.executable, str(JOB), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.ray
@pytest.mark.slow
def test_encode_export_and_resume_by_shard(ray_local, store_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "emb"
    args = ["--prepared", store_dir, "--model", tiny_model_dir, "--out", str(out), "--num-shards", "2",
            "--num-cpus", "0.25", "--batch-size", "8", "--encode-dtype", "fp32", "--blink-t7", "--no-progress"]
    first = encode_kb(args, ray_local)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "0 of 2 shards reused" in first.stderr

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "embedding_snapshot" and manifest["num_entities"] == N
    assert manifest["shape"] == [N, 32] and manifest["dtype"] == "float32" and manifest["preset"] == "dual"
    assert [s["source"] for s in manifest["shards"]] == ["encoded", "encoded"]
    vecs = np.load(out / "embeddings.npy")
    assert vecs.shape == (N, 32) and vecs.dtype == np.float32 and np.isfinite(vecs).all()
    assert (out / "ids.txt").read_text().splitlines() == [str(700 + i) for i in range(N)]
    assert torch.equal(torch.load(out / "embeddings.t7", weights_only=True), torch.from_numpy(vecs))

    # A partial run: shard 1 never persisted its version, the export never happened.
    shutil.rmtree(out / "shards" / "shard-001-of-002" / "v00000000")
    for name in ("manifest.json", "embeddings.npy", "embeddings.t7"):
        (out / name).unlink()
    resumed = encode_kb(args, ray_local)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 of 2 shards reused" in resumed.stderr
    again = json.loads((out / "manifest.json").read_text())
    assert [s["source"] for s in again["shards"]] == ["reloaded", "encoded"]
    np.testing.assert_array_equal(np.load(out / "embeddings.npy"), vecs)


def test_an_out_dir_of_another_model_or_preset_is_refused(store_dir, tiny_model_dir, tmp_path, capsys):
    """Checked before Ray starts, so the job's main() runs in-process here."""
    out = tmp_path / "emb"
    out.mkdir()
    (out / job.SPEC_FILE).write_text(json.dumps({"preset": "dual", "m": None, "model": "elsewhere"}))
    code = job.main(["--prepared", store_dir, "--model", tiny_model_dir, "--out", str(out), "--preset", "multi",
                     "--m", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "differs in: " in err and "m, model" in err and "preset" in err and "--overwrite" in err
    # nothing written but the lock the job held while it checked (dist_nce.core.run_lock)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, job.SPEC_FILE]


def test_a_second_encode_into_a_live_ones_out_is_refused(store_dir, tiny_model_dir, tmp_path, capsys):
    """Another encode of this --out is live (its lock held here): refused, the holder named, nothing
    touched; once it has ended, the same command runs its checks."""
    out = tmp_path / "emb"
    out.mkdir()
    (out / job.SPEC_FILE).write_text(json.dumps({"preset": "dual", "m": None, "model": "elsewhere"}))
    argv = ["--prepared", store_dir, "--model", tiny_model_dir, "--out", str(out), "--overwrite"]
    with acquire(out):
        assert job.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another job (pid {os.getpid()} on host" in err and "use another --out" in err
        assert (out / job.SPEC_FILE).exists(), "--overwrite cleared a live encode's directory"


def test_overwrite_clears_all_but_the_lock(tmp_path):
    """--overwrite empties --out under the job's own lock: removing the lock file too would let a second job
    lock a new file of that name while this one runs."""
    out = tmp_path / "emb"
    (out / "shards" / "shard-000-of-002").mkdir(parents=True)
    (out / "embeddings.npy").write_bytes(b"x")
    (out / job.SPEC_FILE).write_text(json.dumps({"model": "elsewhere"}))
    with acquire(out) as lock:
        job.check_out_dir(out, {"model": "this one"}, overwrite=True)
        assert [p.name for p in out.iterdir()] == [LOCK_FILE] and lock.held
        with pytest.raises(RunDirBusy):
            acquire(out)


def test_a_saved_retriever_directory_brings_its_own_preset(store_dir, tiny_model_dir, tmp_path):
    from dist_nce.index.encode import state_fingerprint
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig
    from kb.store import EntityStore

    retriever = Retriever.build(RetrieverConfig(preset="multi", m=2, mention_model=tiny_model_dir))
    retriever.save_pretrained(tmp_path / "retriever")
    parse = job.build_parser().parse_args
    config, state, tokenizer_sha, dim = job.load_entity_side(
        parse(["--prepared", store_dir, "--model", str(tmp_path / "retriever"), "--out", "x"]))
    assert (config.preset, config.m, dim) == ("multi", 2, 32)
    assert tokenizer_sha == EntityStore(store_dir).manifest["tokenizer_sha256"]
    assert state_fingerprint(state) == state_fingerprint(retriever.entity_encoder_state())
    with pytest.raises(ValueError, match="is a multi .m=2. retriever"):
        job.load_entity_side(parse(["--prepared", store_dir, "--model", str(tmp_path / "retriever"), "--out", "x",
                                    "--preset", "dual"]))


def test_a_blink_biencoder_file_is_a_model(store_dir, tmp_path):
    """BLINK's released biencoder layout (here tiny, with legacy LayerNorm names): the entity side is the
    cand_encoder, its fingerprint the one every other entry point computes for the same file."""
    from dist_nce.index.encode import state_fingerprint
    from dist_nce.modeling.resolve import load_retriever
    from kb.store import EntityStore
    from tests.blink_helpers import write_blink_biencoder

    bi = write_blink_biencoder(tmp_path / "biencoder_wiki_large.bin")
    parse = job.build_parser().parse_args
    config, state, tokenizer_sha, dim = job.load_entity_side(
        parse(["--prepared", store_dir, "--model", str(bi), "--out", "x", "--storage-dtype", "float32"]))
    assert (config.preset, config.m, config.storage_dtype, dim) == ("dual", None, "float32", 64)
    assert tokenizer_sha == EntityStore(store_dir).manifest["tokenizer_sha256"]
    assert state_fingerprint(state) == state_fingerprint(load_retriever(bi).entity_encoder_state())
    config, _, _, _ = job.load_entity_side(parse(["--prepared", store_dir, "--model", str(bi), "--out", "x",
                                                  "--preset", "multi", "--m", "2"]))
    assert (config.preset, config.m) == ("multi", 2)


def test_model_path_errors_are_named(store_dir, tiny_model_dir, tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_text("not torch")
    for model, extra, message in ((junk, [], f"{junk}: not a torch.save'd state dict"),
                                  (tmp_path / "nowhere", [], "nowhere: --model not found"),
                                  (tiny_model_dir, ["--tokenizer", tiny_model_dir], "--tokenizer is for a BLINK")):
        code = job.main(["--prepared", store_dir, "--model", str(model), "--out", str(tmp_path / "o"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err
