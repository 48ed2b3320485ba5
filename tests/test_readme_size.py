"""README.md stays short enough to read in two minutes (at most 300 lines; the rest lives on docs/ pages it
links to, and it links every one), and no relative link of README.md or of a page under docs/ is broken: every
target file exists and every ``#anchor`` names a heading of the page it points to (GitHub's heading ids)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # the README and the pages it links out to
CHECKED = PAGES + sorted(set((REPO / "docs").rglob("*.md")) - set(PAGES))  # and each run's page under docs/

FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).*?\1", re.S)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")  # http:, https:, mailto:, ...: not a file here


def prose(text: str) -> str:
    """``text`` without code blocks and code spans (a bracket or path there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """The targets of every inline and reference-style link (and image) outside code."""
    body = prose(text)
    return INLINE_LINK.findall(body) + REFERENCE_LINK.findall(body)


def slug(heading: str) -> str:
    """GitHub's id for a heading: link text kept, lowercased, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The ids a page's headings get (a repeated heading gets -1, -2, ...), and explicit HTML ids."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def broken_links(page: Path) -> list[str]:
    """``"target: why"`` for each relative link of ``page`` whose file or heading does not exist."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{target}: {dest.name} has no heading #{anchor}")
    return problems


def test_readme_is_at_most_300_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, \
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move a section to a docs/ page and link it"


def test_readme_links_every_docs_page():
    """Each docs/*.md page is reachable from the README in one click."""
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README.read_text(encoding="utf-8"))
              if not SCHEME.match(t)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md links no docs page {unlinked}"


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    if page == README:  # it links every page: none found means the pattern broke, not that all is well
        assert len(links(page.read_text(encoding="utf-8"))) >= len(PAGES) - 1, "README.md: links not found"
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(REPO)}: broken links:\n  " + "\n  ".join(problems)


def test_the_link_check_can_fail(tmp_path):
    """A missing file, a missing heading and a link inside code (not a link) are told apart."""
    (tmp_path / "other.md").write_text("# Title\n\n## The jobs (a `x.py`)\n\n## The jobs (a `x.py`)\n",
                                       encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-jobs-a-xpy) [dup](other.md#the-jobs-a-xpy-1) [self](#here)\n\n## Here\n\n"
                    "[gone](missing.md) [bad](other.md#nope) `[code](nowhere.md)` [web](https://example.com/x)\n"
                    "```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")
    assert slug("5. Negatives") == "5-negatives" and slug("On one H100 (issue 23)") == "on-one-h100-issue-23"
    problems = broken_links(page)
    assert [p.split(":")[0] for p in problems] == ["missing.md", "other.md#nope"], problems
