"""The stated length distribution of the realistic-lengths rows (issue 37): the token lengths of the synthetic
KILT knowledge source's entities, as ``prepare_kb`` tokenizes them (MiniLM's vocabulary, BLINK's
``title [ENT] text`` at ``entity_max_len`` 128), kept as a histogram in ``benchmarks/data/kb_lengths.json``
so that a GPU machine without the tokenizer or the generator draws the same lengths.

Mentions need no table: AIDA's contexts are longer than BLINK's 32-token window on both sides, so every
prepared mention fills it (``prepare_kb`` reports 100% truncated at 32 on the synthetic AIDA files).

Regenerate (about a minute; the histogram is deterministic for the generator's seed)::

    .venv/bin/python -m benchmarks.kb_lengths --entities 5000
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RESULT = Path(__file__).resolve().parent / "data" / "kb_lengths.json"  # an input of benchmarks, not a result


def load(path: Path = RESULT) -> dict[int, int]:
    """length -> number of entities."""
    data = json.loads(path.read_text())
    return {int(k): int(v) for k, v in data["histogram"].items()}


def sample(n: int, rng: np.random.Generator, width: int = 128, path: Path = RESULT) -> np.ndarray:
    """``n`` lengths drawn from the histogram, scaled from its 128 positions to ``width`` (>= 1 each)."""
    hist = load(path)
    lengths = np.array(sorted(hist), dtype=np.int64)
    p = np.array([hist[k] for k in lengths], dtype=np.float64)
    top = int(json.loads(path.read_text())["entity_max_len"])
    drawn = rng.choice(lengths, size=n, p=p / p.sum())
    return np.clip(np.ceil(drawn * width / top).astype(np.int64), 1, width)


def measure(entities: int, seed: int = 0) -> dict:
    """Generate the synthetic KILT source, prepare it, and histogram its entities' token lengths."""
    import pyarrow.ipc as ipc

    with tempfile.TemporaryDirectory() as tmp:
        src, store = Path(tmp) / "kilt", Path(tmp) / "store"
        py = sys.executable
        subprocess.run([py, "-m", "kb.synthetic", "kilt", "--out", str(src), "--entities", str(entities),
                        "--train", "10", "--dev", "10", "--test", "10", "--seed", str(seed)], check=True,
                       capture_output=True)
        subprocess.run([py, "-m", "dist_nce.cli.prepare_kb", "--out", str(store), "--kilt-ks",
                        str(src / "kilt_knowledgesource.json"), "--entity-max-len", "128", "--no-progress"],
                       check=True, capture_output=True)
        lengths = np.concatenate([ipc.open_file(p).read_all().column("length").to_numpy()
                                  for p in sorted((store / "entities").glob("part-*.arrow"))])
    values, counts = np.unique(lengths, return_counts=True)
    return {"source": f"python -m kb.synthetic kilt --entities {entities} --seed {seed}; prepare_kb "
                      "--entity-max-len 128 (shipped MiniLM tokenizer)",
            "entities": int(lengths.size), "entity_max_len": 128, "mean": float(lengths.mean()),
            "percentiles": {str(q): float(np.percentile(lengths, q)) for q in (0, 10, 25, 50, 75, 90, 100)},
            "histogram": {str(int(v)): int(c) for v, c in zip(values, counts)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entities", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    data = measure(args.entities, args.seed)
    RESULT.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in data.items() if k != "histogram"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
