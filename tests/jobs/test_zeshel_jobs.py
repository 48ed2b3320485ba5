"""jobs/zeshel_retriever.py then jobs/zeshel_reranker.py, as a user runs them: subprocesses on a real local Ray.

Synthetic Zeshel (2 train, 2 val, 1 test worlds of 60 documents), the random tiny BERT,
configs/zeshel/test_tiny.yaml and reranker_test_tiny.yaml with every path moved to tmp.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from dist_nce.eval.zeshel import read_candidates
from dist_nce.modeling.retriever import Retriever
from dist_nce.retrieval import build_local_index, retrieve
from dist_nce.worker.tb import read_metrics
from dist_nce.zeshel.evaluate import index_config, own_world_topk, split_world_ranges
from kb.store import EntityStore, MentionTable

REPO = Path(__file__).resolve().parents[2]
K = 16  # zeshel.k and the reranker's C in the test configs

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def run(job: str, config: str, address: str, *sets: str, flags: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """The job in its own process, joining the test process's local Ray through RAY_ADDRESS, as under
    ``ray job submit`` (a job that starts its own local Ray: tests/jobs/test_chaos.py)."""
    cmd = [sys.executable, str(REPO / "jobs" / job), "--config", str(REPO / "configs" / "zeshel" / config), *flags]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RAY_ADDRESS": address})


@pytest.fixture(scope="module")
def retriever_run(ray_local, tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("zeshel_jobs")
    # The dense sampler, the default when the reranker test's learning bar was set on this retriever's
    # candidates: the block sampler (the default since) draws from the same law, but another draw, and on
    # the candidates of the retriever it trains the tiny reranker's loss fell 0.04 in 32 steps, not > 0.1.
    r = run("zeshel_retriever.py", "test_tiny.yaml", ray_local, f"model.retriever.mention_model={tiny_model_dir}",
            f"data.prepared_dir={tmp / 'train_kb'}", f"zeshel.eval_store={tmp / 'eval_kb'}",
            f"zeshel.synthetic_dir={tmp / 'src'}", f"run.storage_path={tmp / 'ray'}", f"run.output_dir={tmp / 'run'}",
            "service.index.sampler=dense")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp, r


def own_world_scores(model, store, mentions) -> list[dict[int, float]]:
    """Every mention's score for every entity of its world: {row: score}, one dict per mention."""
    out: list[dict[int, float]] = [{} for _ in mentions.mention_ids]
    worlds = np.asarray(mentions.worlds, dtype=object)
    for world, (a, b) in split_world_ranges(store, mentions).items():
        idx = np.flatnonzero(worlds == world)
        got = retrieve(model, mentions, build_local_index(model, store, index_config(model, "auto"), rows=(a, b),
                                                          progress=False), b - a, indices=idx, progress=False)
        for j, i in enumerate(idx):
            out[i] = dict(zip(got.rows[j].tolist(), got.scores[j].tolist()))
    return out


def test_retriever_job(retriever_run):
    tmp, r = retriever_run
    out = tmp / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] and summary["plan"]["num_entities"] == 120  # negatives: the 2 train worlds only
    metrics = read_metrics(out / "metrics.jsonl")
    losses = [m["train/loss"] for _, m in sorted(metrics.items()) if "train/loss" in m]
    assert len(losses) == summary["plan"]["total_steps"]
    assert "dev_after/recall@16" in metrics[summary["plan"]["total_steps"]]  # heldout_train_seen, over the shards

    # Labelled metrics, printed and in the summary; the union of a split's worlds is the harder setting.
    assert "own_world" in r.stdout and "split_union" in r.stdout and "the Zeshel protocol" in r.stdout
    z = summary["zeshel"]
    assert set(z) == {"train", "val", "test"} and "split_union" not in z["train"]
    assert set(z["val"]["own_world"][f"recall@{K}"]["per_world"]) == {"muppets", "ice_hockey"}
    for split in ("val", "test"):
        own, union = z[split]["own_world"][f"recall@{K}"], z[split]["split_union"][f"recall@{K}"]
        assert union["micro"] <= own["micro"]
        assert own["macro"] == pytest.approx(np.mean([v["value"] for v in own["per_world"].values()]))

    # Candidates files: every mention, K documents of its own world, best first = the exported model's ranking.
    model = Retriever.from_pretrained(out / "model")
    for split, store_dir in (("train", "train_kb"), ("val", "eval_kb"), ("test", "eval_kb")):
        store, mentions = EntityStore(tmp / store_dir), MentionTable(tmp / store_dir, split)
        cands = read_candidates(out / "candidates" / f"candidates_{split}.json")
        assert list(cands) == mentions.mention_ids
        rows = own_world_topk(model, store, mentions, K, index_config(model, "auto"), progress=False)
        worlds = store.worlds(rows.ravel())
        assert worlds == [w for w in mentions.worlds for _ in range(K)]
        # The job wrote its lists through another search (split union for val/test) in another
        # process: near-tied scores of the tiny model may come out in another order, so compare
        # scores, not ids: each list is a top K of the mention's world, best first.
        scores = own_world_scores(model, store, mentions)
        for i, m in enumerate(mentions.mention_ids):
            listed = store.rows_for_source_ids(cands[m]).tolist()
            assert len(set(listed)) == K and all(r in scores[i] for r in listed), (split, m)  # its own world's
            got = np.array([scores[i][r] for r in listed])
            want = np.array([scores[i][r] for r in rows[i]])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=f"{split} mention {m}")


def test_reranker_job_trains_resumes_and_evaluates(ray_local, retriever_run, tiny_model_dir):
    tmp, _ = retriever_run
    sets = [f"model.reranker.model={tiny_model_dir}", f"data.train_store={tmp / 'train_kb'}",
            f"data.eval_store={tmp / 'eval_kb'}", f"data.candidates_dir={tmp / 'run' / 'candidates'}",
            f"run.storage_path={tmp / 'ray'}", f"run.output_dir={tmp / 'rerank'}"]
    first = run("zeshel_reranker.py", "reranker_test_tiny.yaml", ray_local, *sets, "run.stop_after_steps=16")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped at step 16" in first.stdout and "gold inserted for" in first.stdout
    # Ray Train's snapshot of the run's checkpoints as a driver killed mid-rewrite leaves it: empty. The rerun
    # resumes from the newest whole checkpoint instead (worker.launch.recover_unrecorded) ...
    snapshot = tmp / "ray" / "zeshel_reranker_test_tiny" / "checkpoint_manager_snapshot.json"
    assert json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]["step"] == 16
    snapshot.write_text("")
    second = run("zeshel_reranker.py", "reranker_test_tiny.yaml", ray_local, *sets)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed at step 16" in second.stdout + second.stderr and "finished" in second.stdout
    assert "snapshot was cut off" in second.stdout + second.stderr, second.stdout[-3000:] + second.stderr[-3000:]
    assert snapshot.with_name(snapshot.name + ".cut").exists()
    # ... and Ray Train wrote a whole snapshot of its own since, naming the last checkpoint: a next rerun
    # resumes from it as usual (a readable snapshot is left to Ray: tests/worker/test_launch.py)
    assert json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]["step"] == 32
    # A rerun with another batch is refused before Ray or any worker starts (the workers refused it, each
    # restart with a traceback, and the job ended in Ray Train's error); its dry run says so too
    for flags in (["--dry-run"], []):
        changed = run("zeshel_reranker.py", "reranker_test_tiny.yaml", ray_local, *sets, "optim.batch_size=8",
                      flags=flags)
        assert changed.returncode == 2 and "cannot resume this run with a different plan" in changed.stderr, \
            changed.stdout[-2000:] + changed.stderr[-2000:]
        assert "global_batch: checkpoint 4, now 8" in changed.stderr and "Traceback" not in changed.stderr
        assert "run zeshel_reranker_test_tiny:" not in changed.stdout  # stopped before the plan was shown

    summary = json.loads((tmp / "rerank" / "summary.json").read_text())
    assert summary["done"] and summary["step"] == summary["plan"]["total_steps"] == 32
    assert summary["engine"]["accelerator"] == "cpu" and summary["engine"]["device"] == "cpu"  # the worker's own
    losses = [m["train/loss"] for _, m in sorted(read_metrics(tmp / "rerank" / "metrics.jsonl").items())
              if "train/loss" in m]
    assert len(losses) == 32 and np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.1  # it learns
    retriever = json.loads((tmp / "run" / "summary.json").read_text())["zeshel"]
    for split in ("val", "test"):
        rep = summary["eval"][split]
        u, n = rep["unnormalized_accuracy"], rep["normalized_accuracy"]
        recall = rep[f"candidate_recall@{K}"]
        # The candidates are the retriever's own-world top K: same recall; U.Acc = N.Acc x recall.
        assert recall["micro"] == pytest.approx(retriever[split]["own_world"][f"recall@{K}"]["micro"])
        assert u["micro"] == pytest.approx(n["micro"] * recall["micro"])
        assert set(u["per_world"]) == set(retriever[split]["own_world"][f"recall@{K}"]["per_world"])
        assert 0.0 <= u["macro"] <= 1.0
        # the choice per mention, written by the worker: U.Acc again from it
        lines = [json.loads(x) for x in Path(rep["predictions_file"]).read_text().splitlines()]
        assert rep["predictions_file"] == str(tmp / "rerank" / "predictions" / f"{split}.jsonl")
        assert u["micro"] == pytest.approx(sum(x["correct"] for x in lines) / len(lines))
    assert "U.Acc macro" in second.stdout and (tmp / "rerank" / "reranker" / "manifest.json").exists()
    # BLINK's cross-encoder layout beside the directory holds the pooler head only (this config's is 'cls')
    assert summary["config"]["model"]["reranker"]["head"] == "cls"
    assert summary["blink_export"] is None and "only head 'pooler' has its layout" in summary["blink_skipped"]
    assert not (tmp / "rerank" / "crossencoder_blink.bin").exists()
