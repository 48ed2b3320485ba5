"""A human summary of a prepared store (what ``jobs/prepare_kb.py`` prints at the end)."""
from __future__ import annotations

import os
from pathlib import Path

from kb.store import open_manifest


def summarize(store_dir: str | os.PathLike) -> str:
    m = open_manifest(store_dir)
    ent = m["entities"]
    ts = ent["token_stats"]
    lines = [f"prepared KB: {Path(store_dir).resolve()}",
             f"  source: {m['source']['format']} ({', '.join(m['source']['entity_files'])})",
             f"  tokenizer: {m['tokenizer']['name']} (sha256 {m['tokenizer_sha256'][:12]}), "
             f"entity max {m['entity_max_len']}, mention max {m['mention_max_len']}",
             f"  entities: {ent['count']:,} in {len(ent['parts'])} part(s); tokens mean {ts['mean']}, "
             f"max {ts['max']}, {100 * ts['truncated_fraction']:.1f}% truncated at {m['entity_max_len']}"]
    if ent.get("worlds"):
        lines.append(f"  worlds: {len(ent['worlds'])} (" + ", ".join(
            f"{w} {b - a:,}" for w, (a, b) in ent["worlds"].items()) + ")")
    for split, info in m.get("mentions", {}).items():
        g = info["gold"]
        lines.append(f"  mentions {split}: {info['count']:,}; gold by id {g['id']:,}, by title {g['title']:,}, "
                     f"missing {g['missing']:,}, unlabelled {g['unlabelled']:,}; tokens mean "
                     f"{info['token_stats']['mean']}, {100 * info['token_stats']['truncated_fraction']:.1f}% "
                     f"truncated")
        if g["missing"]:
            ids = info["missing_gold"]["mention_ids"]
            lines.append(f"    missing gold (mention ids, see manifest): {', '.join(ids[:5])}"
                         + (" ..." if len(ids) > 5 else ""))
    sk = m["skipped"]
    lines.append(f"  skipped records: {sk['count']:,}")
    lines += [f"    {r['path']}:{r['line']}: {r['reason']}" for r in sk["records"][:10]]
    if sk["count"] > 10:
        lines.append(f"    ... {sk['count'] - 10:,} more (first {sk['listed']} in manifest.json)")
    lines += [f"  WARNING: {w}" for w in m.get("warnings", [])]
    ing = m.get("ingest", {})
    if ing:
        lines.append(f"  ingest: {ing['chunks']} chunks ({ing['reused_chunks']} reused), {ing['workers']} "
                     f"worker(s), {ing['seconds']} s")
    return "\n".join(lines)
