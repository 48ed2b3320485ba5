"""Prepare a knowledge base for training: source files -> Arrow entity store + mention tables.

    .venv/bin/python jobs/prepare_kb.py --kilt-ks kilt_knowledgesource.json --aida-dir aida/ \
        --workers 8 --out data/kilt_minilm
    .venv/bin/python jobs/prepare_kb.py --zeshel-root zeshel/ --zeshel-strip-title \
        --mention-max-len 128 --out data/zeshel_minilm
    .venv/bin/python jobs/prepare_kb.py --blink-entities entity.jsonl --aida-dir aida/ --out data/blink

Interrupted (Ctrl-C, or the process killed: its workers exit with it)? Run the same
command again: completed chunks are reused. Malformed lines stop the run with
``file:line: reason``; ``--on-bad-record skip`` skips and lists them. An empty source or
mention split is an error naming the file (``--allow-empty`` accepts it); a split whose
gold entities mostly miss the KB is prepared with a loud warning. A Zeshel tree gives the
mention splits it has (the log names any of train/val/test it lacks). ``--overwrite``
replaces a store prepared from other inputs only once the new one is complete, so a
failed attempt leaves the old store as it was. All logic lives in kb/prepare.py (also
runnable as ``python -m kb.prepare``).
"""
import sys
from pathlib import Path

# Run from a checkout without relying on the editable install's package mapping.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kb.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
