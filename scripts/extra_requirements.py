#!/usr/bin/env python3
"""Print the requirements of one setup.py extra, one a line, read from setup.py's source.

`make lock` compiles the dev lock from these, so the dev layer holds only the dev extra's
packages (and what they need), never the runtime set a second time:

    python scripts/extra_requirements.py dev | uv pip compile - ...
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def extra_requirements(extra: str, setup: Path = SETUP) -> list[str]:
    call = next(n for n in ast.walk(ast.parse(setup.read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    extras = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "extras_require"), {})
    if extra not in extras:
        raise SystemExit(f"{sys.argv[0]}: setup.py has no extra {extra!r} (it has: {', '.join(sorted(extras))})")
    return list(extras[extra])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} EXTRA")
    print("\n".join(extra_requirements(sys.argv[1])))
