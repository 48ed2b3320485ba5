"""Prepare a knowledge base for training (``jobs/prepare_kb.py``): kb.prepare's command line.

The logic lives in :mod:`kb.prepare` (below the package's layers, beside ``dist_nce.core``),
so this module only names it as a job.
"""
from __future__ import annotations

import sys

from kb.prepare import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
