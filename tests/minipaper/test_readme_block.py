"""The README's mini-paper tables are what the committed run's JSON renders, and that run is complete."""
import json
from pathlib import Path

from dist_nce.minipaper.report import RESULT, readme_block, rewrite_readme, tables

REPO = Path(__file__).resolve().parents[2]


def committed() -> dict:
    return json.loads((REPO / RESULT).read_text(encoding="utf-8"))


def test_readme_block_equals_what_the_committed_json_renders():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme_block(text) == tables(committed(), level=4), \
        "README.md's <!-- minipaper --> block differs from docs/mini_paper/mini_paper.json: run " \
        "`.venv/bin/python -m dist_nce.minipaper.report`"


def test_the_committed_run_has_its_seeds_and_plots():
    """Every seed configured is a cell of the run; Table 1 and AIDA rows are there. (The committed
    run may still lack cells: the README says which, and the job finishes them when rerun.)"""
    result = committed()
    seeds = result["config"]["seeds"]
    assert len(seeds) >= 3
    for part in ("zeshel", "aida"):
        assert {g["arm"] for g in result[part]["groups"]} >= {"random", "hard", "mixed50"}, part
        assert all(set(g["seeds"]) <= set(seeds) for g in result[part]["groups"])
    missing = [c["name"] for c in result["cells"] if c["status"] != "done"]
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert not missing or "Not finished in this commit" in text, missing
    for png in ("zeshel_curves.png", "aida_curves.png", "zeshel_bias.png"):
        assert (REPO / "docs" / "mini_paper" / png).stat().st_size > 1000


def test_a_changed_number_makes_the_block_stale():
    result = committed()
    text = "a\n<!-- minipaper -->\nold\n<!-- /minipaper -->\nb\n"
    fresh = rewrite_readme(text, result)
    g = result["zeshel"]["groups"][0]
    metric = next(m for m in result["zeshel"]["metrics"] if m.startswith("val/R@"))
    g[metric]["mean"] += 0.01
    assert rewrite_readme(fresh, result) != fresh
