"""Import precomputed entity encodings (BLINK's all_entities_large.t7, a .npy) as index version 0.

    .venv/bin/python jobs/import_encodings.py --encodings models/all_entities_large.t7 \\
        --model models/biencoder_wiki_large.bin --prepared data/blink_kb --ids models/entity.jsonl \\
        --num-shards 8 --out data/blink_encodings

The job is dist_nce/cli/import_encodings.py (also ``python -m dist_nce.cli.import_encodings``
and ``dist-nce-import-encodings``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.import_encodings import main

if __name__ == "__main__":
    raise SystemExit(main())
