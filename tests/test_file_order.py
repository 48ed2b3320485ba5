"""The suite's schedule: test files longest first (tests/conftest.py, tests/durations.json)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import DURATIONS, file_order

REPO = Path(__file__).resolve().parents[1]


def test_files_go_longest_first_and_unknown_ones_last_in_their_order():
    seconds = {"tests/b.py": 5.0, "tests/c.py": 300.0, "tests/d.py": 5.0}
    assert file_order(["tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py", "tests/e.py"], seconds) == \
        ["tests/c.py", "tests/b.py", "tests/d.py", "tests/a.py", "tests/e.py"]


def test_every_timed_file_exists_and_xdist_keeps_the_order():
    seconds = json.loads(DURATIONS.read_text())
    assert seconds and all(isinstance(v, (int, float)) and v >= 0 for v in seconds.values())
    missing = [f for f in seconds if not (REPO / f).is_file()]
    assert not missing, f"tests/durations.json names files that are gone (scripts/test_durations.py): {missing}"
    xdist = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("XDIST :="))
    assert "--dist loadfile" in xdist and "--no-loadscope-reorder" in xdist, xdist


def test_the_collection_is_ordered_by_the_durations_file():
    """pytest --collect-only over three files lists them in durations.json's order, not by name."""
    seconds = json.loads(DURATIONS.read_text())
    files = sorted(["tests/test_file_order.py", "tests/core/test_text.py", "tests/test_layers.py"])
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    seen = list(dict.fromkeys(m.group(1) for m in re.finditer(r"^(tests/\S+\.py)::", r.stdout, re.M)))
    assert seen == file_order(files, seconds), seen


def test_durations_are_read_from_a_junit_report(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from test_durations import file_seconds
    finally:
        sys.path.pop(0)
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.jobs.test_chaos" name="a" time="100.5"/>'
        '<testcase classname="tests.jobs.test_chaos" name="b" time="20"/>'
        '<testcase classname="tests.core.test_config.TestRanges" name="c" time="1.25"/>'
        '</testsuite></testsuites>')
    assert file_seconds(str(tmp_path / "j.xml")) == {"tests/core/test_config.py": 1.2, "tests/jobs/test_chaos.py": 120.5}


def test_the_readme_states_the_suites_minutes_from_the_durations_file():
    """README.md's time for `make test` is the durations file's seconds over the Makefile's pytest processes."""
    seconds = sum(json.loads(DURATIONS.read_text()).values())
    workers = int(re.search(r"^TEST_WORKERS \?= (\d+)$", (REPO / "Makefile").read_text(), re.M).group(1))
    said = re.search(r"`make\s+test`.*?takes?\s+about\s+(\d+)\s+minutes\s+on\s+2\s+cores",
                     (REPO / "README.md").read_text(), re.S)
    assert said, "README.md no longer says how long `make test` takes"
    minutes = seconds / workers / 60
    assert abs(int(said.group(1)) - minutes) <= 1, \
        f"README.md says about {said.group(1)} minutes; tests/durations.json sums to {minutes:.1f} per process"


def test_test_file_names_are_unique():
    """pytest imports test files by their base name (no __init__.py under tests/): a second file of the same name
    in another folder is a collection error of the whole suite ("import file mismatch"), seen once."""
    names: dict[str, list[str]] = {}
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(f.name, []).append(str(f.relative_to(REPO)))
    assert not {n: fs for n, fs in names.items() if len(fs) > 1}
