"""JSON-lines plumbing shared by the format readers.

Every reader is a pure ``parse_*(line, path, lineno)`` that raises
:class:`dist_nce.core.records.BadRecord`, driven by :func:`read_records`, which streams the file
one line at a time (files such as the 35 GB KILT knowledge source are never loaded
whole) and routes each malformed line to the caller's :class:`BadRecordLog`.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Iterator, TypeVar

from dist_nce.core.records import BadRecord, BadRecordLog

T = TypeVar("T")

_DIGITS = re.compile(r"[0-9]+")


# A byte order mark opens files saved by some Windows editors; JSON parsers may ignore it (RFC 8259, 8.1), and
# Python's json refuses it: read as a bad first line, it cost the file its first record.
UTF8_BOM = b"\xef\xbb\xbf"


def read_records(
    path: str | os.PathLike,
    parse: Callable[[str, str, int], T],
    bad: BadRecordLog | None = None,
) -> Iterator[T]:
    """Yield ``parse(line, path, lineno)`` for each non-blank line of ``path`` (1-based).

    A line that is not UTF-8 or that ``parse`` rejects goes to ``bad`` (default: raise
    at the first). Lines are decoded one by one so a bad byte is reported at its line
    rather than aborting the whole stream.
    """
    bad = bad if bad is not None else BadRecordLog("error")
    where = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(UTF8_BOM)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.report(where, lineno, f"not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                record = parse(line, where, lineno)
            except BadRecord as e:
                bad.report(e.path, e.line, e.reason)
                continue
            yield record


def load_object(line: str, path: str, lineno: int) -> dict[str, Any]:
    """The JSON object on ``line``, or :class:`BadRecord`."""
    try:
        # without the line's own newline: json would place an error at a line cut short on "line 2,
        # column 1" (reported here as column 1) and call an unterminated string's newline a control character
        obj = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        # Some of json's messages end in "at" ("Invalid control character at"); say it once.
        msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg
        raise BadRecord(path, lineno, f"not JSON ({msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadRecord(path, lineno, f"expected a JSON object, got {_json_type(obj)}")
    return obj


_TYPE_NAMES = {str: "string", int: "integer", list: "list", dict: "object"}


def require(obj: dict, key: str, kind: type | tuple[type, ...], path: str, lineno: int,
            where: str = "") -> Any:
    """``obj[key]`` checked to be of ``kind``; ``where`` prefixes the key in messages
    (e.g. ``output[0].``). Booleans are never accepted as integers."""
    name = f"{where}{key}"
    if key not in obj:
        raise BadRecord(path, lineno, f"missing field {name!r}")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise BadRecord(path, lineno, f"field {name!r}: expected {expected}, got {_json_type(value)}")
    return value


def require_digits(obj: dict, key: str, path: str, lineno: int, where: str = "") -> str:
    """``obj[key]`` as a string of ASCII digits (how KILT writes ``wikipedia_id``)."""
    value = require(obj, key, str, path, lineno, where)
    if not _DIGITS.fullmatch(value):
        raise BadRecord(path, lineno, f"field {where + key!r}: expected a string of digits, got {value!r}")
    return value


def is_digits(value: str) -> bool:
    return bool(_DIGITS.fullmatch(value))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    return _TYPE_NAMES.get(type(value), type(value).__name__)
