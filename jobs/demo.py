"""The README's main job on its embedded default: synthetic KILT + AIDA -> prepared store.

    make demo                 # creates .venv, installs, runs this
    .venv/bin/python jobs/demo.py --entities 5000 --out data/demo

Writes a synthetic KILT knowledge source and AIDA train/dev/test files in their real
formats (kb.synthetic), prepares them into the memory-mapped Arrow store (kb.prepare)
and prints the store's summary.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kb.prepare import PrepareConfig, prepare, summarize
from kb.synthetic.kilt import write_kilt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/demo", help="output folder (git-ignored)")
    ap.add_argument("--entities", type=int, default=5000)
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--dev", type=int, default=200)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    out = Path(args.out)
    source = out / "source"
    paths = write_kilt(source, args.entities, args.train, args.dev, args.test, seed=args.seed,
                       missing_gold=0.01)
    print(f"synthetic KILT + AIDA written to {source}")
    prepare(PrepareConfig(out=str(out / "prepared"), kilt_ks=str(paths["kb"]),
                          aida_dir=str(source), workers=2))
    print(summarize(out / "prepared"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
