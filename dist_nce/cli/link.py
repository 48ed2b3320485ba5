"""Link mentions in new text with a trained run: one sentence, a JSONL file, or interactively.

    python jobs/link.py --run runs/demo/<time> --text "Tulsa is a city in [Oklahoma] ."
    python jobs/link.py --run runs/demo/<time> --input docs.jsonl --output linked.jsonl
    python jobs/link.py --run runs/demo/<time> --input data/demo/synthetic/aidayago2-dev-kilt.jsonl \\
        --output dev_guess.jsonl --format kilt
    python jobs/link.py --run runs/demo/<time> --interactive      # one sentence per line, [brackets]

Without a run: a retriever directory or BLINK's released biencoder over a prepared store, the
KB's embeddings from ``jobs/encode_kb.py --out`` (``--snapshot``; or ``--kb encode``, or
``--searcher service --shard-dir <encode_kb out>/shards``), optionally BLINK's cross-encoder::

    python jobs/link.py --model models/biencoder_wiki_large.bin --store data/prepared/kilt_bert \\
        --snapshot data/embeddings/blink --reranker models/crossencoder_wiki_large.bin \\
        --text "Tulsa is a city in [Oklahoma] ."

BLINK files are read with ``--tokenizer`` (default: the default model's, bert-uncased's vocabulary);
an index encoded by other weights than the model's is refused, never searched.

Input lines (JSONL) are ``{"text": ..., "mentions": [[start, end], ...]}`` (character spans),
KILT inputs ``{"id": ..., "input": "left [START_ENT] mention [END_ENT] right"}`` or BLINK's mention
lines ``{"context_left": ..., "mention": ..., "context_right": ...}``; output
lines are the same documents, every field kept, with ``mentions`` holding per mention its span,
its text and the top-k entities (id, title, store row, retriever score, reranker score when
``--reranker`` is given). ``--output`` is written whole or not at all. ``--format kilt`` writes KILT guess
lines instead (one per input id: answer = top-1 title, provenance = ranked ids). ``--blink-scores
scores.json`` scores a BLINK benchmark file (its ``label_id`` the gold page) as BLINK's run_benchmark.py
does (dist_nce.eval.blink says how it counts), e.g. with BLINK's released files, k = 100::

    python jobs/link.py --model models/biencoder_wiki_large.bin --store data/prepared/blink \
        --snapshot data/embeddings/blink --reranker models/crossencoder_wiki_large.bin --k 100 \
        --input data/BLINK_benchmark/AIDA-YAGO2_testb.jsonl --output testb_linked.jsonl \
        --blink-scores testb_scores.json

The KB is searched in this process (``--searcher local``: the run's exported KB snapshot,
or ``--kb encode``) or through the trainer's sharded NegativeService on Ray
(``--searcher service``, for large KBs; ``--set service.num_shards=8`` etc.). Every
LinkConfig field can come from ``--config`` YAML or ``--set key=value`` (``--help-config``).
Exit status 2 on bad input or configuration, with ``file:line: reason``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO


from dist_nce.cli.common import error
from dist_nce.core.config import AT_LEAST_1, ConfigError, describe, from_dict, load_config, parse_overrides
from dist_nce.core.flags import FlagParser, choice, missing_input, number, refuse
from dist_nce.link.config import LinkConfig

if TYPE_CHECKING:
    from dist_nce.link.linker import Linker

# Checked after parsing: the README's command lines are parsed where their paths do not exist.
INPUTS = {"--run": "dir", "--input": "file", "--config": "file", "--store": "dir", "--model": "any",
          "--tokenizer": "dir", "--snapshot": "dir", "--reranker": "any"}
CHUNK = 256  # documents linked per call in batch mode (encoder batches are LinkConfig.batch_size)
# (LinkConfig key, type, help): each is an option --<key> (service.shard_dir: --shard-dir). The types
# refuse what the config would refuse anyway, but as the flag's value and before any model loads.
LINK_OPTIONS = (
    ("k", number(int, AT_LEAST_1), "entities per mention"),
    ("searcher", choice("local", "service"), "local or service"),
    ("kb", choice("snapshot", "encode"), "snapshot or encode (local searcher)"),
    ("store", str, "prepared store"),
    ("model", str, "retriever directory or BLINK biencoder file (biencoder_wiki_large.bin), instead of --run"),
    ("tokenizer", str, "tokenizer directory for BLINK files (default: the default model's)"),
    ("snapshot", str, "exported KB embeddings (jobs/encode_kb.py --out) for the local searcher"),
    ("service.shard_dir", str, "where the service's shards persist/reuse embeddings (<encode_kb out>/shards)"),
    ("reranker", str, "reranker directory or BLINK cross-encoder file (crossencoder_wiki_large.bin)"),
    ("device", str, "cpu, cuda, ..."),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = FlagParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="run directory (runs/<name>/<time>); or --model and --store")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--text", help='one sentence with mentions in [brackets] (or KILT markers)')
    mode.add_argument("--input", help="JSONL of documents to link")
    mode.add_argument("--interactive", action="store_true", help="read sentences from stdin, one per line")
    ap.add_argument("--output", help="output JSONL (batch mode; default: stdout)")
    ap.add_argument("--format", choices=["jsonl", "kilt"], default="jsonl", help="batch output format")
    ap.add_argument("--blink-scores", metavar="JSON", help="--input is a BLINK benchmark file (context_left, "
                    "mention, context_right, label_id): write BLINK's table for it, counted as BLINK counts")
    ap.add_argument("--config", help="YAML of LinkConfig fields")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="LinkConfig override")
    for name, kind, what in LINK_OPTIONS:
        flag = name.removeprefix("service.").replace("_", "-")
        ap.add_argument(f"--{flag}", type=kind, dest=name.replace(".", "_"), help=f"LinkConfig.{name}: {what}")
    ap.add_argument("--threads", type=number(int, AT_LEAST_1), default=None, help="intra-op threads (default: torch's)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    ap.add_argument("--help-config", action="store_true", help="print every LinkConfig field and exit")
    return ap.parse_args(argv)


def link_config(args: argparse.Namespace) -> LinkConfig:
    sets = list(args.set)
    for name, _, _ in LINK_OPTIONS:
        value = getattr(args, name.replace(".", "_"))
        if value is not None:
            sets.append(f"{name}={json.dumps(value) if isinstance(value, str) else value}")
    if not args.progress:
        sets.append("progress=false")
    if args.config:
        return load_config(LinkConfig, args.config, sets)
    return from_dict(LinkConfig, parse_overrides(sets), "--set")


def print_answer(doc: dict, out: TextIO = sys.stdout) -> None:
    """A human-readable table of one linked document."""
    for m in doc["mentions"]:
        print(f"{m['mention']!r}" + (f" [{m['span'][0]}, {m['span'][1]})" if m["span"] else ""), file=out)
        for rank, e in enumerate(m["entities"], 1):
            rerank = f"  rerank {e['rerank_score']:9.4f}" if "rerank_score" in e else ""
            print(f"  {rank:>3}. {e['title']:<40} id {e['id']:<12} score {e['score']:9.4f}{rerank}", file=out)


def read_docs(path: str, kilt: bool = False, blink: bool = False) -> list[tuple[int, dict]]:
    """(line number, document) of every non-empty line; each checked, errors as file:line.
    ``kilt``: each line must also make one KILT guess line (an 'id', exactly one mention); ``blink``: each
    line must be a BLINK mention line with its ``label_id``."""
    from dist_nce.link.inputs import BLINK_FIELDS, parse_docs

    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                mentions = parse_docs([doc])
            except ValueError as e:  # json.JSONDecodeError is one
                raise ValueError(f"{path}:{lineno}: {str(e).removeprefix('doc 0: ')}") from None
            if kilt and ("id" not in doc or len(mentions) != 1):
                raise ValueError(f"{path}:{lineno}: --format kilt needs an 'id' and exactly one mention per line")
            if blink and not ("mention" in doc and "label_id" in doc):
                raise ValueError(f"{path}:{lineno}: --blink-scores needs BLINK mention lines "
                                 f"({', '.join(BLINK_FIELDS)}) with a 'label_id'")
            docs.append((lineno, doc))
    return docs


def kilt_lines(docs: list[tuple[int, dict]], linked: list[dict]) -> list[dict]:
    from dist_nce.eval.kilt import guess_record

    out = []
    for (_, doc), ans in zip(docs, linked):  # read_docs(kilt=True) checked each has an id and one mention
        ents = ans["mentions"][0]["entities"]
        out.append(guess_record(doc["id"], [e["id"] for e in ents], ents[0]["title"] if ents else ""))
    return out


def batch(linker: Linker, args: argparse.Namespace, docs: list[tuple[int, dict]]) -> None:
    """Link ``docs`` to ``args.output`` (written whole or not at all: a file is renamed into place once
    every document is linked), or to stdout as they are linked."""
    import contextlib

    from tqdm.auto import tqdm

    from dist_nce.core.artifacts import atomic_path

    mentions = 0
    scored: list[tuple[str | None, list[int], int | None]] = []  # --blink-scores: (page id, rows, reranked top)
    with contextlib.ExitStack() as stack:
        if args.output:
            sink = stack.enter_context(open(stack.enter_context(atomic_path(args.output)), "w", encoding="utf-8"))
        else:
            sink = sys.stdout
        bar = stack.enter_context(tqdm(total=len(docs), desc="link", unit="doc", mininterval=1.0,
                                       disable=not linker.config.progress))
        for a in range(0, len(docs), CHUNK):
            chunk = docs[a:a + CHUNK]
            linked = linker.link([d for _, d in chunk], progress=False)
            # each input document with every field it came with; its mentions replaced by the linked ones
            lines = kilt_lines(chunk, linked) if args.format == "kilt" else \
                [{**doc, **ans} for (_, doc), ans in zip(chunk, linked)]
            sink.write("".join(json.dumps(x, ensure_ascii=args.format == "kilt") + "\n" for x in lines))
            mentions += sum(len(x["mentions"]) for x in linked)
            if getattr(args, "blink_scores", None):
                from dist_nce.eval.blink import linked_rows, page_id

                scored += [(page_id(doc["label_id"]), *linked_rows(ans["mentions"][0]["entities"]))
                           for (_, doc), ans in zip(chunk, linked)]
            bar.update(len(chunk))
    print(f"linked {mentions} mentions in {len(docs)} documents" + (f" -> {args.output}" if args.output else ""),
          file=sys.stderr)
    if scored:
        write_blink_scores(linker, args, scored)


def write_blink_scores(linker: Linker, args: argparse.Namespace,
                       scored: list[tuple[str | None, list[int], int | None]]) -> None:
    """BLINK's table for the linked file (dist_nce.eval.blink) to ``args.blink_scores``, and its row to stderr."""
    import numpy as np

    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.eval.blink import blink_scores, format_table

    ids = [p for p, _, _ in scored]
    known = [i for i, p in enumerate(ids) if p is not None]
    gold = np.full(len(ids), -1, dtype=np.int64)
    gold[known] = linker.store.rows_for_source_ids([ids[i] for i in known])
    reranked = [top for _, _, top in scored]
    scores = blink_scores(np.array([rows for _, rows, _ in scored], dtype=np.int64).reshape(len(scored), -1), gold,
                          None if reranked[0] is None else np.array(reranked, dtype=np.int64))
    atomic_write_json(args.blink_scores, {"input": str(Path(args.input).resolve()),
                                          "reranker": linker.config.reranker, **scores})
    print(format_table(Path(args.input).name, scores) + f" -> {args.blink_scores}", file=sys.stderr)


def interactive(linker: Linker) -> None:
    from dist_nce.link.inputs import parse_brackets

    tty = sys.stdin.isatty()
    if tty:
        print("one sentence per line, mentions in [brackets]; Ctrl-D ends", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if not line.strip():
            continue
        try:
            print_answer(linker.link([parse_brackets(line.rstrip("\n"))], progress=False)[0])
        except ValueError as e:  # a bad line is reported; the session goes on
            print(f"error: {e}", file=sys.stderr)
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print(describe(LinkConfig))
        return 0
    code = missing_input(args, INPUTS)
    if code is not None:
        return code
    if args.format == "kilt" and not args.input:
        return refuse("--format", "kilt", "writes one guess line per line of --input; give --input")
    if args.blink_scores and not args.input:
        return refuse("--blink-scores", args.blink_scores, "scores the lines of --input; give --input")
    for flag, out in (("--output", args.output), ("--blink-scores", args.blink_scores)):
        if out and not Path(out).resolve().parent.is_dir():
            return refuse(flag, out, f"directory {Path(out).resolve().parent} not found")
    if not args.run and not args.model:
        return error("give --run (a run directory) or --model (a retriever directory or BLINK biencoder file) "
                     "with --store")
    try:
        cfg = link_config(args)
        doc = None
        if args.text is not None:
            from dist_nce.link.inputs import parse_brackets, parse_docs

            doc = parse_brackets(args.text)
            parse_docs([doc])  # a bad sentence fails before the model loads
        # Every input line is read and checked before the model loads: a bad line (or one --format kilt
        # cannot write) is refused before any output file is opened.
        docs = read_docs(args.input, kilt=args.format == "kilt", blink=bool(args.blink_scores)) if args.input \
            else None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return error(e)

    from dist_nce.cluster.runtime import configure_process
    from dist_nce.core.artifacts import ArtifactMismatch
    from dist_nce.link.linker import Linker

    configure_process(args.threads)
    try:
        linker = Linker.from_pretrained(args.run, cfg)
    except (ArtifactMismatch, ConfigError, FileNotFoundError, ValueError) as e:
        return error(e)
    with linker:
        print(f"linker: {args.run or cfg.model}, {linker.store.num_entities:,} entities, searcher {cfg.searcher}"
              + (f", reranker {cfg.reranker}" if cfg.reranker else ""), file=sys.stderr)
        try:
            if doc is not None:
                print_answer(linker.link([doc], progress=False)[0])
            elif args.input:
                batch(linker, args, docs)
            else:
                interactive(linker)
        except ValueError as e:
            return error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
