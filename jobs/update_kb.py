"""Change a prepared knowledge base without rebuilding it: add, remove, replace entities.

    .venv/bin/python jobs/update_kb.py --store data/kilt --add new_pages.json --remove gone_ids.txt
    .venv/bin/python jobs/update_kb.py --store data/kilt --add fixed.json --remove fixed_ids.txt  # replace
    .venv/bin/python jobs/update_kb.py --store data/kilt --compact --out data/kilt_compact

A running NegativeService takes the new version with ``service.apply_delta()`` (README,
"Keeping the KB current"). All logic lives in kb/delta.py (also runnable as
``python -m kb.delta``, ``python -m dist_nce.cli.update_kb`` and ``dist-nce-update-kb``);
``--help`` and its docstring say more.
"""
from dist_nce.cli.update_kb import main

if __name__ == "__main__":
    raise SystemExit(main())
