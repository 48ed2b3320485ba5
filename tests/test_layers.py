"""The package's layering (`.importlinter`) holds, and the checker does catch a break."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def lint_imports(root: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    """import-linter's own command line on ``root``'s `.importlinter`, reading the packages found
    first on ``pythonpath`` (grimp parses the files; nothing of the project is imported)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--config", str(root / ".importlinter")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_every_contract_is_kept():
    proc = lint_imports(REPO, REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") == 4


@pytest.mark.parametrize("file, line, contract", [
    ("dist_nce/core/text.py", "from dist_nce.train import plan", "Imports point down the layers BROKEN"),
    ("kb/store.py", "from dist_nce.modeling import scoring", "kb stands on dist_nce.core alone BROKEN"),
    ("dist_nce/index/search.py", "import tests.train.fakes", "imports no test, benchmark or job script BROKEN"),
    ("dist_nce/sampling/topk.py", "from dist_nce.sampling import negatives", "No import cycles"),
])
def test_a_broken_layer_is_reported(tmp_path, file, line, contract):
    """A copy of the package with one forbidden import (inside a function: those count too)."""
    for pkg in ("dist_nce", "kb"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    with open(tmp_path / file, "a", encoding="utf-8") as f:
        f.write(f"\n\ndef _upward():\n    {line}\n")
    proc = lint_imports(tmp_path, tmp_path)
    assert proc.returncode != 0
    assert contract in proc.stdout, proc.stdout
