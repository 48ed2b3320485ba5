"""``python -m kb.synthetic {kilt,zeshel} ...``: write synthetic data sets (see kb.synthetic)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from kb.synthetic.lexicon import ZESHEL_WORLD_TABLE
from kb.synthetic.universe import Knobs


def _knob_args(p: argparse.ArgumentParser, default: Knobs) -> None:
    p.add_argument("--topics", type=int, default=None, help="number of topics (default: from the KB size)")
    p.add_argument("--context-words", type=int, nargs=2, metavar=("MIN", "MAX"), default=default.context_words,
                   help="words on each side of a mention")
    p.add_argument("--signature-keep", type=float, default=default.signature_keep,
                   help="chance each gold signature word appears in a context")


def _knobs(args: argparse.Namespace, default: Knobs) -> Knobs:
    return dataclasses.replace(default, num_topics=args.topics, context_words=tuple(args.context_words),
                               signature_keep=args.signature_keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kb.synthetic", description=__doc__)
    sub = parser.add_subparsers(dest="format", required=True)

    k = sub.add_parser("kilt", help="kilt_knowledgesource.json + AIDA KILT files (+ BLINK entity.jsonl)")
    k.add_argument("--out", required=True)
    k.add_argument("--entities", type=int, required=True)
    k.add_argument("--train", type=int, default=2000)
    k.add_argument("--dev", type=int, default=500)
    k.add_argument("--test", type=int, default=500)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--blink", action="store_true", help="also write BLINK entity.jsonl")
    k.add_argument("--title-drift", type=float, default=0.03, help="fraction of outdated AIDA gold titles")
    k.add_argument("--missing-gold", type=float, default=0.0, help="fraction of golds absent from the KB")
    k.add_argument("--workers", type=int, default=1, help="processes rendering KB lines (same output for any value)")
    _knob_args(k, Knobs())

    z = sub.add_parser("zeshel", help="Zeshel documents/ and mentions/ tree")
    z.add_argument("--out", required=True)
    z.add_argument("--entities-per-world", type=int, default=1000)
    z.add_argument("--mentions-per-world", type=int, default=500)
    z.add_argument("--worlds", nargs="+", default=None, choices=list(ZESHEL_WORLD_TABLE), metavar="WORLD",
                   help="subset of the 16 Zeshel worlds (default: all)")
    z.add_argument("--seed", type=int, default=0)
    from kb.synthetic.zeshel import ZESHEL_KNOBS

    _knob_args(z, ZESHEL_KNOBS)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    if args.format == "kilt":
        from kb.synthetic.kilt import write_kilt

        paths = write_kilt(args.out, args.entities, args.train, args.dev, args.test, args.seed,
                           blink=args.blink, title_drift=args.title_drift, missing_gold=args.missing_gold,
                           knobs=_knobs(args, Knobs()), progress=args.entities >= 20_000, workers=args.workers)
        entities = args.entities
    else:
        from kb.synthetic.zeshel import write_zeshel

        root = write_zeshel(args.out, args.worlds, args.entities_per_world, args.mentions_per_world, args.seed,
                            knobs=_knobs(args, ZESHEL_KNOBS))
        paths = {"root": root}
        entities = args.entities_per_world * len(args.worlds or ZESHEL_WORLD_TABLE)
    secs = time.perf_counter() - t0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {
        "paths": {k: str(v) for k, v in paths.items()},
        "seconds": round(secs, 2),
        "cpu_seconds": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 2),
        "entities_per_second": round(entities / secs, 1),
        "peak_rss_mib": round(me.ru_maxrss / 1024, 1),  # this process; workers, if any, are reported below
        "peak_rss_mib_workers": round(kids.ru_maxrss / 1024, 1),
    }
    print(json.dumps(report, indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
