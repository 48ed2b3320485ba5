"""Encode a whole prepared KB with an entity encoder, through the EntityShard actors.

A dist-nce retriever directory (``Retriever.save_pretrained``)::

    .venv/bin/python jobs/encode_kb.py --prepared data/kilt_minilm --model runs/aida/retriever \\
        --out data/embeddings/aida --num-shards 4

A Hugging Face model directory, with the score preset it is used under::

    .venv/bin/python jobs/encode_kb.py --prepared data/zeshel_minilm --model /models/bert-base-uncased \\
        --preset multi --m 8 --out data/embeddings/zeshel_multi8 --blink-t7

On a cluster (``ray start --head`` first; the job runs in a copy of ``--working-dir``, so
give absolute paths)::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/encode_kb.py --prepared /data/kilt_minilm --model /runs/aida/retriever \\
        --out /data/embeddings/aida --num-shards 8 --num-gpus 1

The job is dist_nce/cli/encode_kb.py (also ``python -m dist_nce.cli.encode_kb`` and
``dist-nce-encode-kb``); ``--help`` and its docstring say more.
"""
from dist_nce.cli.encode_kb import main

if __name__ == "__main__":
    raise SystemExit(main())
