"""KILT-format entity and AIDA lines, and a prepared store from them: what the KB-delta tests share."""
from __future__ import annotations

import json
import random

from kb.prepare import PrepareConfig, prepare

WORDS = ["alpha", "beta", "gamma", "delta", "river", "north", "stone", "field"]


def kilt_line(wid: int, title: str, rng: random.Random) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 20)))
    return json.dumps({"_id": str(wid), "wikipedia_id": str(wid), "wikipedia_title": title,
                       "text": [title + "\n", body + "\n"], "anchors": [], "categories": "", "history": {}})


def aida_line(i: int, wid: int, title: str) -> str:
    return json.dumps({"id": f"m{i}", "input": f"left [START_ENT] {title} [END_ENT] right",
                       "output": [{"answer": title, "provenance": [{"wikipedia_id": str(wid), "title": title}]}]})


def entities(ids, seed: int = 0, prefix: str = "Page") -> dict[int, str]:
    rng = random.Random(seed)
    return {wid: kilt_line(wid, f"{prefix} {wid}", rng) for wid in ids}


def prepare_store(root, name: str, lines: dict[int, str], model_dir: str, golds=()):
    (root / f"{name}.json").write_text("".join(v + "\n" for v in lines.values()))
    aida = root / f"{name}_aida"
    aida.mkdir()
    (aida / "aidayago2-train-kilt.jsonl").write_text(
        "".join(aida_line(i, wid, f"Page {wid}") + "\n" for i, wid in enumerate(golds)))
    prepare(PrepareConfig(out=str(root / name), kilt_ks=str(root / f"{name}.json"), aida_dir=str(aida),
                          model_dir=model_dir, entity_max_len=24, rows_per_part=16, progress=False,
                          min_gold_resolution=0.0), log=lambda s: None)
    return root / name
