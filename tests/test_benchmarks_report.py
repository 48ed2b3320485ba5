"""The benchmark page's figures come from the committed JSON (benchmarks/report.py), so do the copies of
its blocks on docs/gpu.md and docs/real_data.md, and the README's results table quotes figures of the
generated pages."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

from benchmarks import report  # noqa: E402


def test_page_blocks_equal_what_the_committed_json_renders():
    text = report.PAGE.read_text(encoding="utf-8")
    found = report.blocks(text)
    missing = [name for name in report.names() if name not in found]
    assert not missing, f"docs/benchmarks.md lacks the bench blocks {missing}; has {sorted(found)}"
    stale = [name for name, body in found.items() if body != report.render(name)]
    assert not stale, f"docs/benchmarks.md bench blocks {stale} differ from benchmarks/results/*.json: run " \
                      "`.venv/bin/python -m benchmarks.report` after a benchmark run"
    assert report.stale_blocks(text) == [] and report.main(["--check"]) == 0


def test_copied_blocks_are_on_their_pages_and_equal_what_the_json_renders():
    """docs/gpu.md carries the GPU mining table, the one-GPU AIDA job's and the packed towers' CPU table,
    docs/real_data.md the BLINK import's memory table, each what the committed JSON renders; --check covers
    them."""
    assert report.COPIES["docs/gpu.md"] == ("gpu_mining", "gpu_e2e", "packed")
    assert report.COPIES["docs/real_data.md"] == ("import_rss",)
    for rel, required in report.COPIES.items():
        found = report.blocks((REPO / rel).read_text(encoding="utf-8"))
        assert set(required) <= set(found), f"{rel} lacks the bench blocks {sorted(set(required) - set(found))}"
        stale = [name for name, body in found.items() if body != report.render(name)]
        assert not stale, f"{rel}: bench blocks {stale} differ from benchmarks/results/*.json"
    assert report.stale_copies() == []


def test_a_stale_or_missing_copy_fails_the_check(tmp_path):
    """The copies' check can fail: a copied block out of date, or one a page must carry and lacks."""
    page = tmp_path / "gpu.md"
    page.write_text("prose\n<!-- bench:gpu_mining -->\nold table\n<!-- /bench:gpu_mining -->\n", encoding="utf-8")
    assert report.stale_copies(copies={str(page): ("gpu_mining",)}) == [f"{page} gpu_mining"]
    page.write_text("prose without the table\n", encoding="utf-8")
    assert report.stale_copies(copies={str(page): ("gpu_mining",)}) == [f"{page} gpu_mining (missing)"]


def test_every_committed_result_the_page_shows_was_recorded_idle():
    """A block the page shows must come from a run the load guard accepted."""
    for block in report.blocks(report.PAGE.read_text(encoding="utf-8")):
        for name in report.sources(block):
            data = json.loads((report.RESULTS / f"{name}.json").read_text())
            assert data.get("noisy") is False, f"benchmarks/results/{name}.json: recorded noisy or before the load guard"


def test_every_committed_result_has_a_renderer():
    """A result file without a renderer would never reach the page."""
    names = {p.stem for p in report.RESULTS.glob("*.json")}
    assert names == set(report.RENDERERS), f"results without a renderer: {sorted(names - set(report.RENDERERS))}"


# A figure: a number with a decimal point, or one followed by x or % ("0.40x", "59.8", "64%").
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*\.\d+x?|(?<![\w.])\d[\d,]*(?:x|%)")


def readme_results() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Results\n(?P<body>.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no `## Results` section followed by another section"
    return m.group("body")


def results_rows(body: str) -> list[str]:
    """The rows of the Results section's one table (header and separator dropped)."""
    lines = body.splitlines()
    tables = [i for i, line in enumerate(lines)
              if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]
    assert len(tables) == 1, f"README Results: {len(tables)} tables, want one results table"
    assert not [line for line in lines if line.startswith("- ")], "README Results: bullets beside the table"
    rows = [line for line in lines[tables[0]:] if line.startswith("|")]
    assert re.fullmatch(r"\|(---\|)+", rows[1]), f"README Results: no separator under the header: {rows[1]}"
    return rows[2:]


def generated(page: str) -> str:
    """The generated blocks of a page (what the committed JSON renders), without its hand-written prose."""
    from dist_nce.minipaper.report import RESULTS, page_block

    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    if page == "benchmarks.md":
        return "\n".join(report.blocks(text).values())
    return "\n".join(page_block(text, name) or "" for name in RESULTS)


def test_readme_headline_figures_are_on_the_generated_pages():
    """The README's Results section is one table; every figure a row quotes is in a generated table of
    the page that row links to (docs/benchmarks.md, docs/mini_paper.md): a figure of the committed JSON."""
    rows = results_rows(readme_results())
    pages = {name: generated(name) for name in ("benchmarks.md", "mini_paper.md")}
    assert 3 <= len(rows) <= 8, f"README Results: {len(rows)} rows, want 3-8"
    for row in rows:
        linked = [name for name in pages if f"docs/{name}" in row]
        assert linked, f"README Results row links to neither generated page:\n{row}"
        figures = FIGURE.findall(re.sub(r"\]\([^)]*\)", "]", row))  # not the link targets
        assert figures, f"README Results row quotes no figure:\n{row}"
        absent = [f for f in figures if not any(f in pages[name] for name in linked)]
        assert not absent, f"README Results quotes {absent}, not in a generated table of {linked}:\n{row}"


def test_results_rows_reads_one_table_only():
    """The table reader sees every row, and refuses bullets or a second table (the issue asks for one)."""
    table = "intro\n\n| a | b |\n|---|---|\n| x | 1.0x |\n| y | 2% |\n"
    assert results_rows(table) == ["| x | 1.0x |", "| y | 2% |"]
    with pytest.raises(AssertionError, match="2 tables"):
        results_rows(table + "\n" + table)
    with pytest.raises(AssertionError, match="bullets"):
        results_rows(table + "\n- 3.0x more\n")


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


def test_a_page_without_a_result_block_is_stale():
    """--check fails when a committed result has no block on the page, not only when a block is stale."""
    assert report.stale_blocks("no blocks here\n") == [f"{name} (missing)" for name in report.names()]


def test_the_gpu_e2e_block_names_the_gpus_own_compute_time_when_the_run_logged_it():
    """A run logged before time/compute_device_s renders as before; one that logged it shows it inside compute."""
    data = json.loads((REPO / "benchmarks" / "results" / "gpu_e2e.json").read_text())
    assert data["train"]["steps"]["parts"].get("compute_device") is None
    before = report.gpu_e2e(copy.deepcopy(data))
    assert "on the GPU, first kernel to last" not in before
    data["train"]["steps"]["parts"]["compute_device"] = {"share": 0.8, "median_s": 0.1987}
    after = report.gpu_e2e(data)
    assert "on the GPU, first kernel to last, 198.7; the bare engine's step" in after
    assert after.replace("; on the GPU, first kernel to last, 198.7", "") == before
