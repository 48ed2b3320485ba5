"""Readers for Zeshel (Logeswaran et al., 2019): per-world documents and per-split mentions.

Layout under ``root``:
- ``documents/<world>.json``: ``{document_id, title, text}`` per line; ``text`` begins
  with the title.
- ``mentions/<split>.json``: ``{mention_id, context_document_id, corpus, start_index,
  end_index, text, label_document_id, category}`` per line. The indices are INCLUSIVE
  positions in ``context_document.text.split()``; ``corpus`` is the world.

A mention is cut from its context document exactly as BLINK's Zeshel converter does
(whitespace tokens, rejoined by single spaces), and its ``text`` must equal the cut
tokens: a mismatch means the indices point elsewhere and the line is reported.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Collection, Iterator, Mapping

from dist_nce.core.records import BadRecord, BadRecordLog, EntityRecord, MentionRecord
from kb.jsonl import load_object, read_records, require

ZESHEL_WORLDS: dict[str, list[str]] = {
    "train": ["american_football", "doctor_who", "fallout", "final_fantasy", "military",
              "pro_wrestling", "starwars", "world_of_warcraft"],
    "val": ["coronation_street", "elder_scrolls", "ice_hockey", "muppets"],
    "test": ["forgotten_realms", "lego", "star_trek", "yugioh"],
}

ZESHEL_SPLITS: tuple[str, ...] = ("train", "val", "test", "heldout_train_seen", "heldout_train_unseen")

# The heldout splits are mentions from the training worlds kept out of train.
_SPLIT_WORLDS = {"train": "train", "val": "val", "test": "test",
                 "heldout_train_seen": "train", "heldout_train_unseen": "train"}


def worlds_for_split(split: str) -> list[str]:
    """The worlds whose entities a split's mentions link to (heldout splits -> train worlds)."""
    if split not in _SPLIT_WORLDS:
        raise ValueError(f"unknown Zeshel split {split!r}; expected one of {list(ZESHEL_SPLITS)}")
    return list(ZESHEL_WORLDS[_SPLIT_WORLDS[split]])


def document_paths(root: str | os.PathLike, worlds: Collection[str] | None = None) -> list[Path]:
    """``documents/<world>.json`` for ``worlds`` (default: every file there, sorted)."""
    doc_dir = Path(root) / "documents"
    if worlds is None:
        paths = sorted(doc_dir.glob("*.json"))
        if not paths:
            raise FileNotFoundError(f"{doc_dir}: no <world>.json document files")
        return paths
    paths = [doc_dir / f"{w}.json" for w in worlds]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Zeshel document files not found: {', '.join(missing)}")
    return paths


def parse_zeshel_document(line: str, path: str, lineno: int, world: str | None = None) -> EntityRecord:
    """One document line -> EntityRecord(source_id=document_id, description=text).

    ``text`` is kept whole, title included; the tokenizer decides whether to strip it.
    """
    obj = load_object(line, path, lineno)
    doc_id = require(obj, "document_id", str, path, lineno)
    title = require(obj, "title", str, path, lineno)
    text = require(obj, "text", str, path, lineno)
    return EntityRecord(source_id=doc_id, title=title, description=text, world=world,
                        path=path, line=lineno)


def iter_zeshel_documents(
    root: str | os.PathLike,
    worlds: Collection[str] | None = None,
    bad: BadRecordLog | None = None,
) -> Iterator[EntityRecord]:
    """Stream EntityRecords from ``documents/<world>.json``, world by world (world = stem)."""
    for path in document_paths(root, worlds):
        world = path.stem
        yield from read_records(path, lambda line, p, n: parse_zeshel_document(line, p, n, world), bad)


def load_zeshel_documents_text(
    root: str | os.PathLike,
    worlds: Collection[str] | None = None,
    only: Collection[str] | None = None,
    bad: BadRecordLog | None = None,
) -> dict[str, str]:
    """``{document_id: text}`` for ``worlds``; with ``only``, just those ids (so cutting
    mentions keeps only their context documents in memory). A repeated document_id is
    a bad record: a dict would otherwise keep one copy silently."""
    bad = bad if bad is not None else BadRecordLog("error")
    wanted = set(only) if only is not None else None
    texts: dict[str, str] = {}
    for rec in iter_zeshel_documents(root, worlds, bad):
        if wanted is not None and rec.source_id not in wanted:
            continue
        if rec.source_id in texts:
            bad.report(rec.path, rec.line, f"duplicate document_id {rec.source_id!r}")
            continue
        texts[rec.source_id] = rec.description
    return texts


def parse_zeshel_mention(line: str, path: str, lineno: int, documents: Mapping[str, str] | None,
                         worlds: Mapping[str, Mapping[str, str]] | None = None) -> MentionRecord:
    """One mention line -> MentionRecord, cut from ``documents[context_document_id]``.

    ``category`` is optional (None when absent); every other field is required. ``worlds`` (instead of
    ``documents``): ``{world: {document_id: text}}`` of the ``documents/<world>.json`` files; the mention's
    ``corpus`` must be one of them and its context document in that world's file (evaluation groups
    mentions by world: one whose world has no entities used to pass here and fail after training).
    """
    obj = load_object(line, path, lineno)
    mention_id = require(obj, "mention_id", str, path, lineno)
    context_id = require(obj, "context_document_id", str, path, lineno)
    corpus = require(obj, "corpus", str, path, lineno)
    start = require(obj, "start_index", int, path, lineno)
    end = require(obj, "end_index", int, path, lineno)
    text = require(obj, "text", str, path, lineno)
    label_id = require(obj, "label_document_id", str, path, lineno)
    category = require(obj, "category", str, path, lineno) if "category" in obj else None

    if worlds is not None:
        if corpus not in worlds:
            raise BadRecord(path, lineno, f"corpus {corpus!r} has no documents/{corpus}.json beside mentions/")
        documents = worlds[corpus]
    context = documents.get(context_id)
    if context is None:
        raise BadRecord(path, lineno, f"context document {context_id!r} (corpus {corpus!r}) not found in "
                                      f"documents/{corpus}.json")
    tokens = context.split()
    if not 0 <= start <= end < len(tokens):
        raise BadRecord(path, lineno, f"indices [{start}, {end}] (inclusive) outside context document "
                                      f"{context_id!r} of {len(tokens)} whitespace tokens")
    mention = " ".join(tokens[start:end + 1])
    if mention != text:
        raise BadRecord(path, lineno, f"field 'text' {text!r} differs from tokens [{start}, {end}] "
                                      f"of {context_id!r}: {mention!r}")
    return MentionRecord(
        mention_id=mention_id,
        left=" ".join(tokens[:start]),
        mention=mention,
        right=" ".join(tokens[end + 1:]),
        gold_source_id=label_id,
        world=corpus,
        category=category,
        path=path,
        line=lineno,
    )


def _context_needs(path: Path) -> tuple[set[str], set[str]]:
    """(context document ids, corpora) named by well-formed lines of a mentions file;
    malformed lines are left for the real pass to report."""
    ids: set[str] = set()
    corpora: set[str] = set()
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                if isinstance(obj.get("context_document_id"), str):
                    ids.add(obj["context_document_id"])
                if isinstance(obj.get("corpus"), str):
                    corpora.add(obj["corpus"])
    return ids, corpora


def iter_zeshel_mentions(
    root: str | os.PathLike,
    split: str,
    bad: BadRecordLog | None = None,
    documents: Mapping[str, str] | None = None,
) -> Iterator[MentionRecord]:
    """Stream MentionRecords from ``mentions/<split>.json``.

    ``documents`` maps document_id -> text; by default only the context documents the
    split names are loaded, from the worlds its ``corpus`` fields name. A mention whose world
    has no ``documents/<world>.json``, whose context document is not in its world's file, or
    whose indices fall outside it, is a bad record naming ``mentions/<split>.json:<line>``.
    """
    path = Path(root) / "mentions" / f"{split}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Zeshel mentions file for split {split!r} not found")
    worlds = None
    if documents is None:  # world by world: a mention's context document must be in its own world's file
        needed, corpora = _context_needs(path)
        present = [w for w in sorted(corpora) if (Path(root) / "documents" / f"{w}.json").is_file()]
        worlds = {w: load_zeshel_documents_text(root, [w], only=needed, bad=bad) for w in present}
    docs = documents
    return read_records(path, lambda line, p, n: parse_zeshel_mention(line, p, n, docs, worlds), bad)
