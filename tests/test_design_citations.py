"""Every design section the code cites ("docs/design.md section" and a number) exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"docs/design\.md section (\d\w*)")


def test_cited_sections_exist():
    sections = set(re.findall(r"^## (\w+)\. ", (REPO / "docs" / "design.md").read_text(encoding="utf-8"), re.M))
    assert {"1", "5", "6", "7a", "8"} <= sections, sections
    cited = {}
    for folder in ("dist_nce", "kb", "jobs", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".txt", ".md") and path.is_file():
                for n in CITATION.findall(path.read_text(encoding="utf-8")):
                    cited.setdefault(n, []).append(str(path.relative_to(REPO)))
    assert cited, "no citation found: the pattern no longer matches how the code cites the design"
    missing = {n: files for n, files in cited.items() if n not in sections}
    assert not missing, f"cited sections missing from docs/design.md: {missing}"
