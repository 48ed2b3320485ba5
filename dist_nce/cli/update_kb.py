"""Change a prepared knowledge base without rebuilding it (``jobs/update_kb.py``): kb.delta's command line.

The logic lives in :mod:`kb.delta` (below the package's layers, beside ``dist_nce.core``), so
this module only names it as a job.
"""
from __future__ import annotations

import sys

from kb.delta import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
