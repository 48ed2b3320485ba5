"""benchmarks/ stands without tests/: the GPU machine gets the package and benchmarks/ but not tests/,
and a benchmark that imports a test helper fails there with ``No module named 'tests'`` (issue 38).

Checked twice. The source check parses every module under benchmarks/ and finds any import of
``tests``: ``import tests...`` and ``from tests... import``, at the top or inside a function, and
``__import__`` / ``importlib.import_module`` of a literal name. The run check imports every benchmark
module in a fresh interpreter whose sys.path has the repository root but where ``tests`` cannot be
imported."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((REPO / "benchmarks").rglob("*.py"))


def _is_tests(name: str | None) -> bool:
    return name is not None and (name == "tests" or name.startswith("tests."))


def imports_of_tests(source: str) -> list[str]:
    """Each place in ``source`` that imports the ``tests`` package, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_tests(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_tests(node.module):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in ("__import__", "import_module") and _is_tests(node.args[0].value):
                found.append(f"line {node.lineno}: {func}({node.args[0].value!r})")
    return found


def test_the_source_check_finds_every_form_of_import():
    planted = textwrap.dedent("""
        import os, tests.sampling.laws
        from tests import conftest
        from testsuite import x          # another package whose name starts alike
        from . import tests as local     # a relative import: not the tests package
        def law():
            from tests.sampling.laws import chi2_p
            return __import__("tests.sampling"), importlib.import_module("tests")
        """)
    assert [f.split(":")[0] for f in imports_of_tests(planted)] == ["line 2", "line 3", "line 7", "line 8", "line 8"]


def test_the_benchmarks_cover_every_gpu_module():
    names = {p.stem for p in BENCHMARKS}
    assert {"common", "gpu", "gpu_encode", "gpu_train", "report"} <= names, names


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_benchmark_imports_tests(path):
    assert imports_of_tests(path.read_text(encoding="utf-8")) == []


BLOCKED_RUN = """
import importlib, sys

class NoTests:
    # what the GPU machine looks like: the repository root on sys.path, no tests/ beside it
    def find_spec(self, name, path=None, target=None):
        if name == "tests" or name.startswith("tests."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoTests())
try:
    import tests.sampling
except ModuleNotFoundError:
    pass
else:
    sys.exit("the blocker let tests through")
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported", len(sys.argv) - 1)
"""


def test_every_benchmark_imports_where_tests_cannot_be_imported():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in BENCHMARKS]
    proc = subprocess.run([sys.executable, "-c", BLOCKED_RUN, *modules], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split()[-1] == str(len(modules))
