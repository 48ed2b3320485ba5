"""jobs/aida_finetune.py refuses what the KB's size or the cluster cannot hold before it encodes
anything: K or the shard count above the entities (before Ray starts), and shards plus
training workers that need more CPUs than the cluster has (right after Ray starts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_args(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("limits")
    return root, ["--config", "configs/aida/test_tiny.yaml", "--set", f"model.retriever.mention_model={tiny_model_dir}",
                  "--set", f"data.prepared_dir={root / 'kb'}", "--set", f"data.synthetic_dir={root / 'synthetic'}",
                  "--set", f"run.storage_path={root / 'ray_results'}"]


def run_job(args: list[str], out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/aida_finetune.py", *args, "--set", f"run.output_dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ})


def test_more_candidates_than_entities_is_refused_before_ray_starts(data_args, tmp_path):
    root, args = data_args
    r = run_job([*args, "--set", "negatives.num_candidates=500", "--set", "service.num_shards=401"], tmp_path / "out")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert f"error: negatives.num_candidates: 500: must be <= the 400 entities of {root / 'kb'}" in r.stderr
    assert "service.num_shards: 401: must be <= the 400 entities" in r.stderr
    assert (root / "kb" / "manifest.json").is_file()  # the store was prepared: the check needs its size
    assert "Started a local Ray instance" not in r.stdout + r.stderr


def test_shards_and_workers_beyond_the_cluster_are_refused_before_any_encoding(data_args, tmp_path):
    _, args = data_args
    out = tmp_path / "out"
    r = run_job([*args, "--set", "run.cpus_per_worker=64"], out)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "error: the Ray cluster cannot hold this run's actors at once:" in r.stderr
    assert "CPU: 2 shards x 0.25 (service.num_cpus) + 2 training workers x 64 (run.cpus_per_worker) = 128.5 > " \
           in r.stderr
    assert not (out / "shards").exists() and "index version" not in r.stdout
