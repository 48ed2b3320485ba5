"""jobs/mini_paper.py as a user runs it: a small grid of real job processes against one local Ray head.

Synthetic Zeshel and AIDA of the test configs, the random tiny BERT, 2 seeds: per part the
shared start, every arm x seed branching from it (Zeshel), Table 2's rerankers over the chosen
retrievers' candidates, AIDA's random arm (Table 2 and AIDA on one seed of their own, which is
also the per-part ``seeds`` path); then the rerun reuses every cell.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dist_nce.worker.tb import read_metrics

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def run(config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "jobs" / "mini_paper.py"), "--config", str(config), "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def grid(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("mini_paper")
    z = [f"model.retriever.mention_model={tiny_model_dir}", f"data.prepared_dir={tmp / 'z_train'}",
         f"zeshel.eval_store={tmp / 'z_eval'}", f"zeshel.synthetic_dir={tmp / 'z_src'}", "optim.epochs=1",
         "run.eval_every_steps=4", "bias.every_steps=4", "bias.probe_mentions=4", "bias.draws=4",
         "run.checkpoint_every_steps=0",
         # one shard per cell: what runs here is the grid (cells, branches, seeds, tables, reuse), and each
         # shard is a process of ~5 CPU-s; sharded serving is tested in tests/actors and by the AIDA jobs
         "service.num_shards=1"]
    spec = {
        "seeds": [0, 1], "parallel": 3,
        "zeshel": {"config": "configs/zeshel/test_tiny.yaml", "set": z, "warmup": ["negatives.mode=random"],
                   "branch": ["optim.lr=1e-3"], "architectures": {"dual": ["model.retriever.preset=dual"]},
                   "arms": {"random": ["negatives.mode=random"], "hard": ["negatives.mode=hard"]}},
        "reranker": {"config": "configs/zeshel/reranker_test_tiny.yaml", "seeds": [1],
                     "set": [f"model.reranker.model={tiny_model_dir}", f"data.train_store={tmp / 'z_train'}",
                             f"data.eval_store={tmp / 'z_eval'}", "optim.epochs=1", "run.checkpoint_every_steps=0"]},
        "aida": {"config": "configs/aida/test_tiny.yaml", "seeds": [0],
                 "set": [f"model.retriever.mention_model={tiny_model_dir}", f"data.prepared_dir={tmp / 'a_kb'}",
                         f"data.synthetic_dir={tmp / 'a_src'}", "optim.epochs=2", "run.num_workers=1",
                         "run.eval_every_steps=4", "bias.every_steps=4", "bias.probe_mentions=4", "bias.draws=4",
                         "run.checkpoint_every_steps=0", "service.num_shards=1"],
                 # one arm, the baseline every part needs: the AIDA part's cells, groups and curves
                 # (arm comparisons are the Zeshel part's code, tested with two arms here and in
                 # tests/minipaper)
                 "architectures": {"dual": []}, "arms": {"random": ["negatives.mode=random"]}}}
    config = tmp / "grid.yaml"
    config.write_text(yaml.safe_dump(spec))
    r = run(config, tmp / "out")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return tmp, config, r


def test_the_grid_runs_every_cell_and_writes_tables_and_plots(grid):
    tmp, config, r = grid
    out = tmp / "out"
    result = json.loads((out / "mini_paper.json").read_text())
    cells = {c["name"]: c for c in result["cells"]}
    assert set(cells) == {"zeshel-dual-start", *(f"zeshel-dual-{a}-s{s}" for a in ("random", "hard") for s in (0, 1)),
                          "aida-dual-random-s0",
                          *(f"rerank-dual-{a}-s1" for a in ("random", "hard"))}
    assert all(c["status"] == "done" for c in cells.values()), cells
    # every Zeshel branch started from the shared start's exported model
    start_dir = out / cells["zeshel-dual-start"]["dir"]
    for a in ("random", "hard"):
        s = json.loads((out / cells[f"zeshel-dual-{a}-s1"]["dir"] / "summary.json").read_text())
        assert s["config"]["model"]["init_from"] == str(start_dir / "model")
        assert s["config"]["optim"]["seed"] == 1 and s["config"]["negatives"]["mode"] == a
    # each finished cell recorded what it read (a rerun reuses it only while that stays the same): the
    # stores, the model by content, its shared start (Table 2: its retriever) by what that cell reads
    s = json.loads((out / cells["zeshel-dual-hard-s1"]["dir"] / "summary.json").read_text())
    assert {"data.prepared_dir", "zeshel.eval_store", "model.retriever.mention_model", "model.init_from",
            "deepspeed.config"} == set(s["inputs"]) and cells["zeshel-dual-hard-s1"]["inputs"] == s["inputs"]
    assert s["inputs"]["model.init_from"].startswith(f"cell {start_dir.name}: ")
    assert cells["rerank-dual-hard-s1"]["inputs"]["data.candidates_dir"].startswith("cell zeshel-dual-hard-s1-")
    # seeds differ: two seeds of one arm trained on different negatives
    m0, m1 = (read_metrics(out / cells[f"zeshel-dual-hard-s{s}"]["dir"] / "metrics.jsonl") for s in (0, 1))
    assert [v.get("train/loss") for v in m0.values()] != [v.get("train/loss") for v in m1.values()]
    # metrics, curves (dev recall every 4 steps, the bias monitor) and the groups over the 2 seeds
    c = cells["zeshel-dual-hard-s0"]
    assert {"val/R@16", "test/R@16", "val/R@1", "heldout/R@16", "bias/final", "bias/cost", "train/steps_per_s"} \
        <= set(c["metrics"])
    assert len(c["curves"]["dev/recall@16"]) >= 3 and len(c["curves"]["bias/norm"]) >= 2
    groups = {(g["architecture"], g["arm"]): g for g in result["zeshel"]["groups"]}
    assert groups[("dual", "hard")]["val/R@16"]["n"] == 2
    assert {g["arm"] for g in result["aida"]["groups"]} == {"random"}
    assert "dev/accuracy" in result["aida"]["metrics"]
    # Table 2 reranked the chosen retriever's candidates and its architecture's random one's
    assert {(g["architecture"], g["arm"]) for g in result["reranker"]["groups"]} == {("dual", "hard"), ("dual", "random")}
    md = (out / "mini_paper.md").read_text()
    assert "Table 1 in miniature" in md and "| dual | shared start | 1 |" in md
    for png in ("zeshel_curves.png", "aida_curves.png", "zeshel_bias.png", "aida_bias.png"):
        assert (out / png).stat().st_size > 1000
    assert json.loads((out / "manifest.json").read_text())["kind"] == "mini_paper"


def test_a_rerun_reuses_every_finished_cell(grid):
    tmp, config, _ = grid
    before = json.loads((tmp / "out" / "mini_paper.json").read_text())
    r = run(config, tmp / "out")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("finished earlier, reused") == 8 and ": started" not in r.stdout
    after = json.loads((tmp / "out" / "mini_paper.json").read_text())
    assert after["zeshel"] == before["zeshel"] and after["reranker"] == before["reranker"]


def test_a_rerun_over_a_store_prepared_again_in_place_stops_at_the_first_cell_that_read_it(grid):
    tmp, config, _ = grid
    manifest = tmp / "a_kb" / "manifest.json"
    text = manifest.read_text()
    try:
        manifest.write_text(json.dumps({**json.loads(text), "created_utc": "later"}))
        r = run(config, tmp / "out")
    finally:
        manifest.write_text(text)
    assert r.returncode == 2 and ": started" not in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.startswith("error: cell aida-dual-random-s0 finished on other inputs: data.prepared_dir changed") \
        and r.stderr.count("\n") == 1, r.stderr


def test_bad_config_and_parts_are_refused_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0, 1]\nzeshel:\n  arms: {random: []}\n  architectures: {dual: [optim.lr]}\n")
    r = run(bad, tmp_path / "out")
    assert r.returncode == 2 and "architectures.dual: 'optim.lr' is not key=value" in r.stderr
    r = run(REPO / "configs" / "mini_paper" / "tiny_cpu.yaml", tmp_path / "out", "--only", "reranker")
    assert r.returncode == 2 and "add zeshel" in r.stderr
    r = run(REPO / "configs" / "mini_paper" / "tiny_cpu.yaml", tmp_path / "out", "--set", "zeshel.arms.hard=[optim.nope=1]")
    assert r.returncode == 2 and "cell zeshel-dual-hard-s0" in r.stderr and "nope" in r.stderr
    assert not (tmp_path / "out").exists()
