"""Reader for BLINK's ``entity.jsonl``: ``{text, idx, title, entity}`` per line.

``idx`` is a Wikipedia URL such as ``https://en.wikipedia.org/wiki?curid=12``; its
``curid`` is the page's ``wikipedia_id``, which is what KILT and AIDA gold refer to.
"""
from __future__ import annotations

import os
from typing import Iterator
from urllib.parse import parse_qs, urlsplit

from dist_nce.core.records import BadRecord, BadRecordLog, EntityRecord
from kb.jsonl import is_digits, load_object, read_records, require


def curid_from_url(url: str, path: str, lineno: int) -> str:
    """The ``curid`` query parameter of a Wikipedia URL, as a digit string."""
    values = parse_qs(urlsplit(url).query).get("curid", [])
    if len(values) != 1 or not is_digits(values[0]):
        raise BadRecord(path, lineno, f"field 'idx': expected a URL with one numeric curid=, got {url!r}")
    return values[0]


def parse_blink_entity(line: str, path: str, lineno: int) -> EntityRecord:
    """One ``entity.jsonl`` line -> EntityRecord(source_id=curid, description=text).

    BLINK's ``text`` carries a leading and trailing space; they are stripped (they do
    not change tokenization). ``entity`` repeats the title and is not required.
    """
    obj = load_object(line, path, lineno)
    text = require(obj, "text", str, path, lineno)
    url = require(obj, "idx", str, path, lineno)
    title = require(obj, "title", str, path, lineno)
    return EntityRecord(source_id=curid_from_url(url, path, lineno), title=title,
                        description=text.strip(), path=path, line=lineno)


def iter_blink_entities(path: str | os.PathLike, bad: BadRecordLog | None = None) -> Iterator[EntityRecord]:
    """Stream EntityRecords from BLINK's ``entity.jsonl``."""
    return read_records(path, parse_blink_entity, bad)
