"""README benchmark figures come from the committed JSON (benchmarks/report.py)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402


def test_readme_blocks_equal_what_the_committed_json_renders():
    text = report.README.read_text(encoding="utf-8")
    found = report.blocks(text)
    assert {"targets", "mining", "scale", "refresh", "train_step"} <= set(found), \
        f"README.md lacks bench blocks; has {sorted(found)}"
    stale = [name for name, body in found.items() if body != report.render(name)]
    assert not stale, f"README.md bench blocks {stale} differ from benchmarks/results/*.json: run " \
                      "`.venv/bin/python benchmarks/report.py` after a benchmark run"


def test_every_committed_result_the_readme_shows_was_recorded_idle():
    """A block the README shows must come from a run the load guard accepted."""
    for block in report.blocks(report.README.read_text(encoding="utf-8")):
        for name in report.sources(block):
            data = json.loads((report.RESULTS / f"{name}.json").read_text())
            assert data.get("noisy") is False, f"benchmarks/results/{name}.json: recorded noisy or before the load guard"


def test_a_changed_figure_makes_the_block_stale(tmp_path):
    """The check can fail: one median moved in the JSON changes the rendered table."""
    data = json.loads((report.RESULTS / "mining.json").read_text())
    (tmp_path / "mining.json").write_text(json.dumps(data))
    text = "intro\n<!-- bench:mining -->\nold table\n<!-- /bench:mining -->\nrest\n"
    fresh = report.rewrite(text, tmp_path)
    assert fresh.startswith("intro\n<!-- bench:mining -->\n") and fresh.endswith("<!-- /bench:mining -->\nrest\n")
    moved = copy.deepcopy(data)
    row = next(r for r in moved["rows"] if "vs_faiss_topk" in r)
    row["seconds_per_query"]["median"] *= 1.5
    (tmp_path / "mining.json").write_text(json.dumps(moved))
    assert report.rewrite(fresh, tmp_path) != fresh


def test_unknown_or_missing_result_is_named(tmp_path):
    with pytest.raises(KeyError, match="no renderer"):
        report.rewrite("<!-- bench:nope -->\nx\n<!-- /bench:nope -->\n", tmp_path)
    with pytest.raises(FileNotFoundError, match="mining.json"):
        report.rewrite("<!-- bench:mining -->\nx\n<!-- /bench:mining -->\n", tmp_path)
