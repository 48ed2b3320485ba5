"""jobs/import_encodings.py as a BLINK user runs it, then evaluate_kilt_aida on what it imported.

The encodings are made the way BLINK makes ``all_entities_large.t7`` and independently of
the project's encoder: a plain transformers ``BertModel`` holding the checkpoint's
``cand_encoder`` weights, its ``[CLS]`` states of the store's entity token ids, saved in
torch's legacy format (what 2020's torch wrote). BLINK's ranking is computed the same way
(``context_encoder`` ``[CLS]`` states, dot products) and the job's must equal it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.eval.kilt import read_jsonl
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_kilt

from tests.blink_helpers import tiny_bert, write_blink_biencoder

REPO = Path(__file__).resolve().parents[2]
K = 8


def job(name: str, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "jobs" / f"{name}.py"), *args, "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def cls_states(model, ids: np.ndarray) -> torch.Tensor:
    """BLINK's embedding: the [CLS] hidden state of right-padded ids (pad id 0)."""
    ids = torch.from_numpy(ids).long()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state[:, 0]


@pytest.fixture(scope="module")
def blink_files(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("blink_import")
    src = write_kilt(root / "src", 70, 0, 16, 0, seed=11)
    prepare(PrepareConfig(out=str(root / "kb"), kilt_ks=str(src["kb"]), aida_dir=str(root / "src"),
                          model_dir=tiny_model_dir, entity_max_len=32, mention_max_len=32, progress=False),
            log=lambda _: None)
    model = write_blink_biencoder(root / "biencoder_wiki_large.bin", seed=4)
    store = EntityStore(root / "kb")
    cand = tiny_bert(5)  # write_blink_biencoder's cand_encoder: seed + 1
    entities = cls_states(cand, store.token_ids(np.arange(store.num_entities)))
    torch.save(entities, root / "all_entities_large.t7", _use_new_zipfile_serialization=False)
    # BLINK's entity.jsonl order is the .t7's row order; write it shuffled to make the ids matter
    perm = np.random.default_rng(1).permutation(store.num_entities)
    torch.save(entities[perm].clone(), root / "shuffled.t7", _use_new_zipfile_serialization=False)
    titles, ids = store.titles(perm), store.source_ids(perm)
    (root / "entity.jsonl").write_text("".join(
        json.dumps({"text": " t ", "idx": f"https://en.wikipedia.org/wiki?curid={i}", "title": t, "entity": t}) + "\n"
        for t, i in zip(titles, ids)))
    return root, src, entities


@pytest.mark.slow
@pytest.mark.ray
def test_imported_blink_encodings_are_served_without_encoding_and_rank_as_blink(blink_files):
    root, src, entities = blink_files
    out = root / "imported"
    r = job("import_encodings", "--encodings", str(root / "shuffled.t7"), "--ids", str(root / "entity.jsonl"),
            "--model", str(root / "biencoder_wiki_large.bin"), "--prepared", str(root / "kb"),
            "--out", str(out), "--num-shards", "2", "--chunk-rows", "16")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "imported_encodings" and manifest["encodings"]["format"] == "torch-legacy"
    assert manifest["storage_dtype"] == "float16" and len(manifest["shards"]) == 2

    r = job("evaluate_kilt_aida", "--model", str(root / "biencoder_wiki_large.bin"), "--store", str(root / "kb"),
            "--out", str(root / "eval"), "--snapshot-dir", str(out / "shards"), "--k", str(K), "--ks", f"1,{K}",
            "--splits", "dev", "--set", "num_shards=2", "--set", "num_cpus=0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "index version 0: reused the persisted snapshot" in r.stdout

    # BLINK's ranking: context_encoder [CLS] . (the imported fp16 entity rows), best first
    store, mentions = EntityStore(root / "kb"), MentionTable(root / "kb", "dev")
    queries = cls_states(tiny_bert(4), mentions.token_ids(np.arange(len(mentions))))
    scores = queries @ entities.half().float().T
    top = scores.topk(K, dim=1)
    guesses = {g["id"]: [p["wikipedia_id"] for p in g["output"][0]["provenance"]]
               for g in read_jsonl(root / "eval" / "dev_guess.jsonl")}
    for i, mention_id in enumerate(mentions.mention_ids):
        gaps = top.values[i, :-1] - top.values[i, 1:]
        assert gaps.min() > 1e-4, "a near tie would make the comparison depend on summation order"
        assert guesses[mention_id] == [str(s) for s in store.source_ids(top.indices[i].numpy())]


def test_bad_inputs_are_refused_naming_them(blink_files, tmp_path):
    root, _, entities = blink_files
    base = ["--model", str(root / "biencoder_wiki_large.bin"), "--prepared", str(root / "kb"), "--out", str(tmp_path)]
    torch.save(entities[:, :32].clone(), tmp_path / "narrow.t7")
    r = job("import_encodings", "--encodings", str(tmp_path / "narrow.t7"), *base)
    assert r.returncode == 2 and "d = 32, but" in r.stderr and "narrow.t7" in r.stderr
    torch.save(entities[:-1].clone(), tmp_path / "short.t7")
    r = job("import_encodings", "--encodings", str(tmp_path / "short.t7"), *base)
    assert r.returncode == 2 and "69 rows, but the store has 70 entities" in r.stderr
    r = job("import_encodings", "--encodings", str(root / "shuffled.t7"), "--num-shards", "0", *base)
    assert r.returncode == 2 and "--num-shards" in r.stderr and "must be >= 1" in r.stderr
    # an --out whose lock cannot be made (a file in the way): one line naming it, not a traceback
    (tmp_path / "a_file").write_text("")
    r = job("import_encodings", "--encodings", str(root / "shuffled.t7"), *base[:-1], str(tmp_path / "a_file" / "out"))
    assert r.returncode == 2 and "cannot take its lock" in r.stderr and "a_file" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_an_import_for_a_training_config_is_the_runs_version_0(blink_files, tmp_path, capsys):
    """--train-config: the run's own model (build_retriever), store, shard layout (the block
    sampler's row grid) and shard directory; its shards then serve version 0 with no encode."""
    from dist_nce.actors.shard import EntityShard
    from dist_nce.cli.import_encodings import main
    from dist_nce.core.config import load_config
    from dist_nce.index.encode import state_fingerprint
    from dist_nce.train.config import TrainJobConfig, with_absolute_paths
    from dist_nce.train.model import build_retriever

    root, _, entities = blink_files
    overrides = [f"model.blink_checkpoint={root / 'biencoder_wiki_large.bin'}", "model.retriever.mention_model=null",
                 "model.retriever.storage_dtype=float16", f"data.prepared_dir={root / 'kb'}",
                 f"service.shard_dir={tmp_path / 'run_shards'}", f"run.output_dir={tmp_path / 'run'}",
                 "service.index.backend=torch",
                 "service.index.sampler=block", "service.index.block_rows=16"]
    config = REPO / "configs" / "aida" / "test_tiny.yaml"
    args = ["--encodings", str(root / "shuffled.t7"), "--ids", str(root / "entity.jsonl"), "--no-progress",
            "--train-config", str(config), *(x for o in overrides for x in ("--set", o))]
    assert main(args) == 0
    cfg = with_absolute_paths(load_config(TrainJobConfig, config, overrides))
    state = build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state()
    # the BLINK file was fingerprinted off the file, to the digest of the model the run builds
    assert f"encoder fingerprint {state_fingerprint(state)} (read off the file)" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "run_shards" / "manifest.json").read_text())
    assert manifest["row_grid"] == 16 and [s["rows"] for s in manifest["shards"]] == [[0, 32], [32, 70]]
    for i, rows in enumerate(([0, 32], [32, 70])):
        shard = EntityShard(str(root / "kb"), rows, i, 2, cfg.model.retriever, cfg.service,
                            str(tmp_path / "run_shards"), entities.shape[1])
        assert shard.status()["served"] == 0 and shard.status()["encoder_fingerprint"] == state_fingerprint(state)
        assert shard.refresh(state, 0) == 0 and shard.status()["encodes"] == 0

    # a flag that contradicts the config would make a version the run never uses: refused
    assert main([*args, "--num-shards", "3"]) == 2
    capsys.readouterr()

    # the run trains (its job holds the run's lock, held here): its shards are not written under it
    from dist_nce.core.run_lock import acquire

    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run_shards").rglob("*") if p.is_file()}
    import dist_nce.cli.import_encodings as job_module

    def unread(*a):  # refused before the model (a 2.6 GB BLINK file at real size) is read
        raise AssertionError("resolve_target ran before the busy run was refused")

    real, job_module.resolve_target = job_module.resolve_target, unread
    try:
        with acquire(cfg.run.output_dir):
            assert main(args) == 2
    finally:
        job_module.resolve_target = real
    err = capsys.readouterr().err
    assert f"run directory {cfg.run.output_dir} is in use by another job" in err and "import for another run" in err
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run_shards").rglob("*") if p.is_file()} == before
