"""Prepare a knowledge base for training: source files -> Arrow entity store + mention tables.

    .venv/bin/python jobs/prepare_kb.py --kilt-ks kilt_knowledgesource.json --aida-dir aida/ \\
        --workers 8 --out data/kilt_minilm
    .venv/bin/python jobs/prepare_kb.py --zeshel-root zeshel/ --zeshel-strip-title \\
        --mention-max-len 128 --out data/zeshel_minilm
    .venv/bin/python jobs/prepare_kb.py --blink-entities entity.jsonl --aida-dir aida/ --out data/blink

Interrupted (Ctrl-C, or the process killed: its workers exit with it)? Run the same
command again: completed chunks are reused. All logic lives in kb/prepare.py (also
runnable as ``python -m kb.prepare``, ``python -m dist_nce.cli.prepare_kb`` and
``dist-nce-prepare-kb``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.prepare_kb import main

if __name__ == "__main__":
    raise SystemExit(main())
