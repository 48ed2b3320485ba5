"""Change a prepared knowledge base without rebuilding it: add, remove, replace entities.

    .venv/bin/python jobs/update_kb.py --store data/kilt --add new_pages.json --remove gone_ids.txt
    .venv/bin/python jobs/update_kb.py --store data/kilt --add fixed.json --remove fixed_ids.txt  # replace
    .venv/bin/python jobs/update_kb.py --store data/kilt --compact --out data/kilt_compact

Each run writes the next KB version of the store (appended rows, a tombstone set, the
added ids' index) and then its manifest; readers, gold resolution and the KILT writer see
the newest version, earlier ones stay readable until compaction. Malformed lines stop
with ``file:line: reason`` unless ``--on-bad-record skip``. A running NegativeService takes
the new version with ``service.apply_delta()`` (README, "Keeping the KB current"). All
logic lives in kb/delta.py (also runnable as ``python -m kb.delta``).
"""
import sys
from pathlib import Path

# Run from a checkout without relying on the editable install's package mapping.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kb.delta import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
