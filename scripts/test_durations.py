"""Write tests/durations.json from a pytest JUnit XML report: seconds per test file.

``make test`` schedules the test files longest first from this file (tests/conftest.py), so
that the two pytest-xdist workers finish together instead of one running the slowest files
at the end. A stale entry only makes the order less good; refresh it after a full run:

    make test PYTEST_ARGS=--junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml > tests/durations.json
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_seconds(junit_xml: str) -> dict[str, float]:
    """{tests/<path>.py: summed seconds of its tests (setup, call and teardown)}."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        # classname is the module's dotted path, then any class names (Test...): keep the module's
        parts = module.split(".")
        while parts and not parts[-1].startswith("test"):
            parts.pop()
        if not parts:
            continue
        out["/".join(parts) + ".py"] += float(case.get("time", 0))
    return {k: round(v, 1) for k, v in sorted(out.items())}


if __name__ == "__main__":
    json.dump(file_seconds(sys.argv[1]), sys.stdout, indent=1)
    sys.stdout.write("\n")
