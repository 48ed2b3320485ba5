"""benchmarks/ray_start.py at tiny size: one round of each way, one actor each, into a JSON the report renders."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.ray
def test_one_round_of_each_way_records_both_and_their_actors_see_the_same_settings(tmp_path):
    out = tmp_path / "ray_start.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.ray_start", "--rounds", "1", "--actors", "1", "--force",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    node, runtime = data["methods"]["node_env"], data["methods"]["runtime_env"]
    # the way init_ray starts a node leaves the job without a runtime env; the baseline's job has one
    assert node["job_runtime_env"] == {} and runtime["job_runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert node["settings"] == runtime["settings"] and node["settings"]["OMP_NUM_THREADS"] == "1"
    for m in (node, runtime):
        assert m["start_s"]["repeats"] == 1 and m["start_s"]["min"] > 0 and m["cpu_s_per_actor"]["min"] > 0
    text = report.ray_start(data)
    assert "settings in the node's environment" in text and "node / runtime env" in text
