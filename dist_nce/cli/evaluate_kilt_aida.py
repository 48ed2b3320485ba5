"""Evaluate a retriever on KILT AIDA: top-k over ALL entities of a prepared KB, KILT guess files, KILT scores.

    .venv/bin/python jobs/evaluate_kilt_aida.py --model runs/aida/retriever \\
        --store data/prepared/kilt --out runs/aida/eval

    ray start --head --disable-usage-stats          # once; then, from the repository root:
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/evaluate_kilt_aida.py --model $PWD/runs/aida/retriever \\
        --store $PWD/data/prepared/kilt --out $PWD/runs/aida/eval --set num_shards=8

(``ray job submit`` runs the job in a copy of the working directory: give absolute paths.)

``--model`` is a retriever directory or BLINK's released biencoder file (the architecture is
read off the weights, the tokenizer is ``--tokenizer`` or the default model's, which has
bert-uncased's vocabulary; the store must have been prepared with that vocabulary)::

    .venv/bin/python jobs/evaluate_kilt_aida.py --model models/biencoder_wiki_large.bin \\
        --store data/prepared/kilt_bert --out runs/blink/eval --set num_shards=8

Reusing the embeddings of ``jobs/encode_kb.py --model models/biencoder_wiki_large.bin --out
data/embeddings/blink`` (same ``--set num_shards``): add ``--snapshot-dir data/embeddings/blink/shards``.

1. The KB's entity embeddings come from the NegativeService shards (``--set key=value``
   sets any ``ServiceConfig`` field, e.g. ``num_shards``, ``num_gpus``, ``index.backend``).
   The shards persist them under ``--snapshot-dir`` (default ``<out>/snapshot``); a later
   run with the same model and store reloads them instead of re-encoding (so does
   ``--snapshot-dir <out of jobs/encode_kb.py>/shards``, with the same ``num_shards``). A
   snapshot of other weights is never used (its encoder fingerprint differs): a new
   version is encoded beside it.
   ``--searcher local`` encodes and searches in this process instead (small KBs).
2. Each split's mentions (default dev and test) are retrieved over all entities, top
   ``--k`` (100). ``<out>/<split>_guess.jsonl`` gets one line per id of the ORIGINAL
   AIDA file: answer = KB title of the top-1 entity, provenance = the ranked
   wikipedia_ids. Mentions whose gold is not in the KB are retrieved like any other; ids
   the store skipped as malformed get an empty guess (counted, so KILT still sees every id).
3. Splits with answers (dev) are scored with KILT's definitions against the original
   file (``dist_nce.eval.kilt``); the test file without answers gets its guess file only.
   A table is printed; ``<out>/scores.json`` and ``<out>/manifest.json`` are written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dist_nce.actors.config import ServiceConfig
from dist_nce.cli.common import error
from dist_nce.cluster.runtime import configure_process
from dist_nce.core.artifacts import ArtifactMismatch, atomic_write_json, write_manifest
from dist_nce.core.config import AT_LEAST_1, ConfigError, from_dict, load_config, parse_overrides, to_dict
from dist_nce.core.flags import FlagParser, checked, existing, int_list, names, number
from dist_nce.core.text import tokenizer_fingerprint
from dist_nce.eval.kilt import (DEFAULT_KS, KiltFileError, check_gold, id_lines, kilt_scores, read_jsonl,
                                write_guess_file)
from dist_nce.eval.metrics import recall_at_k
from dist_nce.index.encode import state_fingerprint, store_fingerprint
from dist_nce.modeling.resolve import load_retriever
from dist_nce.modeling.retriever import Retriever
from dist_nce.modeling.scoring import is_inner_product
from dist_nce.retrieval import Searcher, build_local_index, ranked_source_ids, retrieve, serve_model
from kb.prepare import AIDA_FILES
from kb.store import EntityStore, MentionTable

KIND, SCHEMA_VERSION = "kilt_aida_eval", 1
# Printed columns: (header, block of kilt_scores, key); then P@1 and R@k from "retrieval".
TABLE = [("accuracy", "downstream", "accuracy"), ("KILT-acc", "kilt", "KILT-accuracy"),
         ("R-prec", "retrieval", "Rprec")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = FlagParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=existing("any"),
                    help="retriever directory (Retriever.save_pretrained) or BLINK "
                         "biencoder checkpoint file (biencoder_wiki_large.bin)")
    ap.add_argument("--tokenizer", type=existing("dir"),
                    help="tokenizer directory for a BLINK file (default: the default model's)")
    ap.add_argument("--store", required=True, type=existing("dir"),
                    help="prepared KB directory (jobs/prepare_kb.py) with AIDA mentions")
    ap.add_argument("--out", required=True, help="output directory: guess files, scores.json, manifest.json")
    ap.add_argument("--aida-dir", type=existing("dir"),
                    help="directory of the original AIDA KILT files (default: the store's source)")
    ap.add_argument("--splits", type=names(tuple(AIDA_FILES)), default="dev,test",
                    help="comma-separated mention splits (default dev,test)")
    ap.add_argument("--k", type=number(int, AT_LEAST_1), default=100,
                    help="entities retrieved per mention (provenance length)")
    ap.add_argument("--ks", type=int_list(AT_LEAST_1), default=",".join(map(str, DEFAULT_KS)),
                    help="k of KILT's precision/recall@k (those above --k are dropped)")
    ap.add_argument("--searcher", choices=["service", "local"], default="service",
                    help="service: NegativeService shards on Ray; local: one in-process index")
    ap.add_argument("--snapshot-dir", help="where shards persist embeddings (default <out>/snapshot)")
    ap.add_argument("--service-config", type=existing("file", "config file"), help="YAML of ServiceConfig fields")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="ServiceConfig override")
    ap.add_argument("--batch-size", type=number(int, AT_LEAST_1), default=128, help="mentions per encoder batch")
    ap.add_argument("--device", type=checked(_device, "device"), default="auto",
                    help="device of the mention encoder (auto: cuda if available)")
    ap.add_argument("--threads", type=number(int, AT_LEAST_1), default=1, help="intra-op threads of this process")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return ap.parse_args(argv)


def _device(text: str) -> str:
    if text != "auto":
        try:
            torch.device(text)
        except RuntimeError as e:  # torch's own reason ("Expected one of cpu, cuda, ...")
            raise ValueError(str(e).split("\n")[0]) from None
    return text


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The shards' config from ``--service-config``/``--set``, read before any model or data."""
    if args.service_config:
        cfg = load_config(ServiceConfig, args.service_config, args.set)
    else:
        cfg = from_dict(ServiceConfig, parse_overrides(args.set), "--set")
    return dataclasses.replace(cfg, shard_dir=args.snapshot_dir or cfg.shard_dir or str(Path(args.out) / "snapshot"))


def fit_backend(args: argparse.Namespace, cfg: ServiceConfig, preset_is_ip: bool) -> None:
    if not preset_is_ip and "backend" not in parse_overrides(args.set).get("index", {}) and not args.service_config:
        cfg.index.backend = "torch"  # faiss serves inner products only (poly-m, SOM)


def guess_rows(gold_ids: list, table_ids: list[str], rows: np.ndarray, store: EntityStore
               ) -> tuple[list[list[str]], list[str], int]:
    """Per gold id (file order): ranked wikipedia_ids and answer (KB title of the top 1).

    Ids absent from the mention table (skipped as malformed when the store was prepared)
    get an empty ranking and answer; returns (ranked, answers, number of such ids)."""
    where = {m: i for i, m in enumerate(table_ids)}
    pos = np.array([where.get(str(g).strip(), -1) for g in gold_ids], dtype=np.int64)
    picked = np.where(pos[:, None] >= 0, rows[np.maximum(pos, 0)], -1)
    ranked = ranked_source_ids(store, picked)
    titles = store.titles(np.maximum(picked[:, 0], 0))
    answers = [t if r >= 0 else "" for t, r in zip(titles, picked[:, 0])]
    return ranked, answers, int((pos < 0).sum())


def print_table(results: dict, ks: list[int]) -> None:
    cols = [c for c, _, _ in TABLE] + ["P@1"] + [f"R@{k}" for k in ks if k > 1]
    print(f"{'split':<6} {'ids':>6} {'no gold in KB':>13} " + " ".join(f"{c:>9}" for c in cols))
    for split, res in results.items():
        s = res.get("kilt")
        if s is None:
            vals = ["-"] * len(cols)
        else:
            vals = [s[g][key] for _, g, key in TABLE] + [s["retrieval"]["precision@1"]]
            vals += [s["retrieval"][f"recall@{k}"] for k in ks if k > 1]
            vals = [f"{v:.4f}" for v in vals]
        missing = res["n_gold_not_in_kb"] if res["labelled"] else "-"
        print(f"{split:<6} {res['n_ids']:>6} {missing:>13} " + " ".join(f"{v:>9}" for v in vals))


def open_searcher(args: argparse.Namespace, retriever: Retriever, store: EntityStore, cfg: ServiceConfig,
                  stack: contextlib.ExitStack) -> tuple[Any, dict[str, Any] | None]:
    """(searcher, snapshot info): NegativeService shards serving this model, or a local index."""
    if args.searcher == "local":
        return build_local_index(retriever, store, cfg.index, progress=args.progress), None
    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import init_ray

    init_ray()
    # d and the tokenizer from the retriever directory itself, not the model dirs it was built from.
    service = NegativeService.create(args.store, retriever.config, cfg, args.out, dim=retriever.hidden_size,
                                     tokenizer_sha256=tokenizer_fingerprint(retriever.tokenizer)["sha256"])
    stack.callback(service.shutdown)
    print(f"KB: {service.num_entities:,} entities in {service.num_shards} shards of ~"
          f"{service.num_entities // service.num_shards:,}; snapshot dir {cfg.shard_dir}")
    plan = serve_model(service, retriever, args.progress)
    print(f"index version {plan.version}: " + ("reused the persisted snapshot" if plan.reused else "encoded"))
    return service, {"version": plan.version, "reused": plan.reused, "dir": cfg.shard_dir}


def evaluate_split(args: argparse.Namespace, retriever: Retriever, store: EntityStore, searcher: Searcher,
                   mentions: MentionTable, gold_file: Path, records: list[dict], ks: list[int]) -> dict:
    """Retrieve, write the guess file, score it if ``records`` (``gold_file``'s) have answers."""
    split = mentions.split
    got = retrieve(retriever, mentions, searcher, args.k, batch_size=args.batch_size, progress=args.progress,
                   desc=f"retrieve {split}")
    ids = [r["id"] for r in records]
    ranked, answers, n_absent = guess_rows(ids, mentions.mention_ids, got.rows, store)
    guess = Path(args.out) / f"{split}_guess.jsonl"
    write_guess_file(guess, ids, ranked, answers)
    if n_absent:
        print(f"{split}: {n_absent} ids of {gold_file} are not in the store (skipped when it was prepared); "
              "they got empty guesses")
    labelled = any("output" in r for r in records)
    gold_rows = mentions.gold_rows
    res = {"gold": str(gold_file), "guess": str(guess), "n_ids": len(ids), "n_mentions": len(mentions),
           "n_ids_not_in_store": n_absent, "labelled": labelled,
           "n_gold_not_in_kb": int((gold_rows < 0).sum()) if labelled else 0, "index_versions": list(got.versions)}
    if labelled:
        res["kilt"] = kilt_scores(gold_file, guess, ks)
        # Over store rows, gold resolved at prepare time: differs from KILT's R@k only by ids
        # the store skipped (KILT counts them as misses; here they are absent).
        res["store_recall"] = {f"recall@{k}": recall_at_k(got.rows, gold_rows, k) for k in ks}
    return res


def evaluate(args: argparse.Namespace, cfg: ServiceConfig) -> int:
    configure_process(args.threads)
    out = Path(args.out)
    ks = sorted({k for k in args.ks if k <= args.k})  # a ranking has k entries
    splits = args.splits
    retriever = load_retriever(args.model, tokenizer_dir=args.tokenizer).eval()
    if retriever.tokenizer is None:
        raise FileNotFoundError(f"{args.model}: no tokenizer/ directory; cannot check the store's token ids")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    retriever.to(auto if args.device == "auto" else args.device)
    store = EntityStore(args.store, tokenizer_sha256=tokenizer_fingerprint(retriever.tokenizer)["sha256"])
    recorded = (store.manifest.get("source") or {}).get("aida_dir")
    aida_dir = Path(args.aida_dir or recorded or ".")
    files = {s: aida_dir / AIDA_FILES[s] for s in splits}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        where = "--aida-dir" if args.aida_dir else \
            "the directory the store was prepared from; pass --aida-dir" if recorded else "no --aida-dir given"
        raise FileNotFoundError(f"{aida_dir} ({where}): AIDA files not found: {', '.join(missing)} (KILT's file "
                                f"names; --splits picks the splits: {', '.join(splits)})")
    # before any retrieval: a bad line, a repeated id or a labelled record KILT cannot score ends it
    gold = {s: read_jsonl(files[s]) for s in splits}
    for s in splits:
        (check_gold if any("output" in r for r in gold[s]) else id_lines)(gold[s], files[s])
    tables = {s: MentionTable(args.store, s) for s in splits}
    fit_backend(args, cfg, is_inner_product(retriever.spec))

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        searcher, snapshot = open_searcher(args, retriever, store, cfg, stack)
        t_index = time.perf_counter() - t0
        results = {s: evaluate_split(args, retriever, store, searcher, tables[s], files[s], gold[s], ks)
                   for s in splits}

    print_table(results, ks)
    report = {"model": str(Path(args.model).resolve()), "store": str(Path(args.store).resolve()), "k": args.k,
              "ks": ks, "searcher": args.searcher, "snapshot": snapshot, "service": to_dict(cfg),
              "index_seconds": round(t_index, 2), "seconds": round(time.perf_counter() - t0, 2), "splits": results}
    atomic_write_json(out / "scores.json", report)
    write_manifest(out, KIND, SCHEMA_VERSION, model=report["model"], store=report["store"],
                   store_fingerprint=store_fingerprint(args.store),
                   encoder_fingerprint=state_fingerprint(retriever.entity_encoder_state()),
                   files=["scores.json", *[Path(r["guess"]).name for r in results.values()]])
    print(f"wrote {out / 'scores.json'} and {len(results)} guess file(s) in {report['seconds']} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = service_config(args)
    except ConfigError as e:
        return error(e)
    try:
        return evaluate(args, cfg)
    except (ArtifactMismatch, ConfigError, KiltFileError, FileNotFoundError, ValueError) as e:
        return error(e)


if __name__ == "__main__":
    sys.exit(main())
