"""Readers for KILT: the Wikipedia knowledge source and the AIDA CoNLL-YAGO files.

``kilt_knowledgesource.json`` (5,903,530 lines, 35 GB) is streamed line by line. Each
line holds ``_id``, ``wikipedia_id`` (a string of digits), ``wikipedia_title``,
``text`` (paragraphs; paragraph 0 is the title line), ``anchors``, ``categories``,
``history`` and, on most lines, ``wikidata_info``. Only the fields an entity needs are
required.

``aidayago2-{train,dev}-kilt.jsonl`` and ``aidayago2-test_without_answers-kilt.jsonl``
hold one mention per line: ``input`` is ``left [START_ENT] mention [END_ENT] right``
(whitespace-tokenised), ``output[0]`` names the gold page, and the test file has no
``output``.
"""
from __future__ import annotations

import os
from typing import Iterator

from dist_nce.core.records import BadRecord, BadRecordLog, EntityRecord, MentionRecord
from kb.jsonl import load_object, read_records, require, require_digits

START_ENT = "[START_ENT]"
END_ENT = "[END_ENT]"


def parse_kilt_entity(line: str, path: str, lineno: int) -> EntityRecord:
    """One knowledge-source line -> EntityRecord(source_id=wikipedia_id).

    The description is paragraphs 1.. stripped and joined by single spaces (paragraph
    0 repeats the title); paragraphs that are empty after stripping are dropped so the
    join never doubles spaces.
    """
    obj = load_object(line, path, lineno)
    source_id = require_digits(obj, "wikipedia_id", path, lineno)
    title = require(obj, "wikipedia_title", str, path, lineno)
    paragraphs = require(obj, "text", list, path, lineno)
    if not paragraphs:
        raise BadRecord(path, lineno, "field 'text': expected a non-empty list of paragraphs, got []")
    for i, p in enumerate(paragraphs):
        if not isinstance(p, str):
            raise BadRecord(path, lineno, f"field 'text[{i}]': expected string, got {type(p).__name__}")
    body = (p.strip() for p in paragraphs[1:])
    description = " ".join(p for p in body if p)
    return EntityRecord(source_id=source_id, title=title, description=description,
                        path=path, line=lineno)


def iter_kilt_entities(path: str | os.PathLike, bad: BadRecordLog | None = None) -> Iterator[EntityRecord]:
    """Stream EntityRecords from ``kilt_knowledgesource.json`` (memory stays flat)."""
    return read_records(path, parse_kilt_entity, bad)


def split_marked_input(text: str, path: str, lineno: int) -> tuple[str, str, str]:
    """``left [START_ENT] mention [END_ENT] right`` -> (left, mention, right), each
    stripped; either context may be empty (marker at the very start or end)."""
    if text.count(START_ENT) != 1 or text.count(END_ENT) != 1:
        raise BadRecord(path, lineno, f"field 'input': expected exactly one {START_ENT} and one {END_ENT}, "
                                      f"found {text.count(START_ENT)} and {text.count(END_ENT)}")
    start = text.index(START_ENT)
    end = text.index(END_ENT)
    if end < start:
        raise BadRecord(path, lineno, f"field 'input': {END_ENT} comes before {START_ENT}")
    left = text[:start].strip()
    mention = text[start + len(START_ENT):end].strip()
    right = text[end + len(END_ENT):].strip()
    return left, mention, right


def parse_aida(line: str, path: str, lineno: int) -> MentionRecord:
    """One KILT AIDA line -> MentionRecord(mention_id=id).

    Gold is ``output[0].provenance[0].wikipedia_id`` and ``output[0].answer``; a line
    without ``output`` (the test file) has gold None. Context comes from the markers in
    ``input``, which is the field every KILT EL file has; ``meta`` is not required.
    """
    obj = load_object(line, path, lineno)
    mention_id = require(obj, "id", (str, int), path, lineno)
    text = require(obj, "input", str, path, lineno)
    left, mention, right = split_marked_input(text, path, lineno)
    gold_id = gold_title = None
    if "output" in obj:
        outputs = require(obj, "output", list, path, lineno)
        if not outputs or not isinstance(outputs[0], dict):
            raise BadRecord(path, lineno, "field 'output': expected a non-empty list of objects")
        gold_title = require(outputs[0], "answer", str, path, lineno, "output[0].")
        provenance = require(outputs[0], "provenance", list, path, lineno, "output[0].")
        if not provenance or not isinstance(provenance[0], dict):
            raise BadRecord(path, lineno, "field 'output[0].provenance': expected a non-empty list of objects")
        gold_id = require_digits(provenance[0], "wikipedia_id", path, lineno, "output[0].provenance[0].")
    return MentionRecord(mention_id=str(mention_id), left=left, mention=mention, right=right,
                         gold_source_id=gold_id, gold_title=gold_title, path=path, line=lineno)


def iter_aida(path: str | os.PathLike, bad: BadRecordLog | None = None) -> Iterator[MentionRecord]:
    """Stream MentionRecords from a KILT AIDA file (train, dev or test_without_answers)."""
    return read_records(path, parse_aida, bad)
