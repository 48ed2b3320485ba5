"""Link mentions in new text with a trained run: one sentence, a JSONL file, or interactively.

    python jobs/link.py --run runs/demo/<time> --text "Tulsa is a city in [Oklahoma] ."
    python jobs/link.py --run runs/demo/<time> --input docs.jsonl --output linked.jsonl
    python jobs/link.py --run runs/demo/<time> --input data/demo/synthetic/aidayago2-dev-kilt.jsonl \\
        --output dev_guess.jsonl --format kilt
    python jobs/link.py --run runs/demo/<time> --interactive      # one sentence per line, [brackets]

The job is dist_nce/cli/link.py (also ``python -m dist_nce.cli.link`` and ``dist-nce-link``);
``--help`` and its docstring say more.
"""
from dist_nce.cli.link import main

if __name__ == "__main__":
    raise SystemExit(main())
