"""A linking request read and checked before any parsing work: body size, time to send it,
UTF-8, JSON nesting, shape, and what it asks the linker to do (docs, text length, spans, k).

Every step is cheap in the body's size and refuses with :class:`BadRequest` (an HTTP status
and a message naming what was wrong, never an exception's text), so that the costly steps
after it (tokenizing, encoding, searching) only ever see requests of bounded size:

* :func:`read_body` stops reading at ``max_request_bytes + 1`` bytes (413), whatever the
  ``Content-Length`` says or whether there is one, and gives the client ``timeout_s`` to send it (408);
* :func:`decode_utf8`: strict UTF-8 (400 naming the first bad byte's offset);
* :func:`check_depth`: nesting deeper than ``max_depth`` (400), found by a scan before
  ``json.loads``, whose recursion a deep body would otherwise exhaust;
* :func:`check_unicode` (in :func:`parse_json`): a lone UTF-16 surrogate (``"\\ud800"`` escaped in the JSON) in any
  string or key (400, or 422 naming the doc and field): it is not a character, the tokenizer
  cannot take it and no answer holding it can be written as UTF-8;
* :func:`check_request`: the docs and k of the decoded body: shape and types (400 for the
  body's, 422 for a doc's, naming the doc and field) and the limits (413) on docs, text
  length, spans per doc and in all, span length and k.

A refusal's message is at most :data:`MAX_MESSAGE` characters: values it quotes are cut
(:func:`shown`), so a refused 900 kB string is not sent back.

The finer checks of each doc (spans inside the text, KILT markers) stay in
:mod:`dist_nce.link.inputs`, which then runs on a bounded request.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dist_nce.link.inputs import BLINK_FIELDS
from kb.kilt import START_ENT


MAX_MESSAGE = 400  # characters of a refusal's message; a longer one is cut
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BadRequest(Exception):
    """A refused request: the HTTP ``status`` and the ``message`` the client gets (at most
    :data:`MAX_MESSAGE` characters, any non-ASCII escaped as in JSON)."""

    def __init__(self, status: int, message: str):
        if len(message) > MAX_MESSAGE:
            message = f"{message[:MAX_MESSAGE - 30]}... ({len(message)} characters)"
        super().__init__(message)
        self.status, self.message = status, message


def shown(value: Any, chars: int = 60) -> str:
    """``value`` as JSON (ASCII, surrogates escaped) for a message: at most ``chars`` characters
    and its full length, never the whole of a large value."""
    if isinstance(value, str) and len(value) > chars:  # cut before encoding: no copy of a large string
        return f"{json.dumps(value[:chars])[:chars]}... (a string of {len(value)} characters)"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (ServeConfig's fields of the same names)."""

    max_request_bytes: int
    max_json_depth: int
    max_docs: int
    max_text_chars: int
    max_mentions: int
    max_mentions_per_doc: int
    max_span_chars: int
    max_k: int


async def read_body(chunks: AsyncIterator[bytes], declared: str | None, max_bytes: int,
                    timeout_s: float) -> bytes:
    """The request body from its stream of ``chunks``, at most ``max_bytes``.

    ``declared``: the Content-Length header, if any; a larger one is refused before reading.
    Reading stops at the first chunk past ``max_bytes`` (413), so a chunked body without a
    length costs at most ``max_bytes`` plus one chunk; a client slower than ``timeout_s`` to
    send the whole body gets 408."""
    if declared is not None:
        if not declared.strip().isdigit():
            raise BadRequest(400, f"Content-Length {declared[:40]!r} is not a number")
        if int(declared) > max_bytes:
            raise BadRequest(413, f"body of {int(declared)} bytes; the limit is {max_bytes}")
    parts: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise BadRequest(413, f"body larger than {max_bytes} bytes; the limit is {max_bytes}")
            parts.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(408, f"request body not received within {timeout_s:g} s ({size} bytes arrived)") from None
    return b"".join(parts)


def decode_utf8(body: bytes) -> str:
    """The body as text; 400 naming the first byte that is not UTF-8."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"body is not UTF-8: byte 0x{body[e.start]:02x} at offset {e.start} "
                              f"({e.reason})") from None


# A JSON string (escapes included) or one bracket: strings are skipped whole, so brackets in text
# are not counted; the unrolled form runs in the regex engine's C loop, not per character here.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def check_depth(text: str, max_depth: int) -> None:
    """400 if ``text`` nests arrays/objects deeper than ``max_depth``.

    Only a bound: malformed JSON is left for the decoder to refuse; the scan stops at the first
    bracket past the limit."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        c = text[m.start()]
        if c in "[{":
            depth += 1
            if depth > max_depth:
                raise BadRequest(400, f"JSON nested deeper than {max_depth} levels (at character {m.start()})")
        elif c in "]}":
            depth -= 1


def parse_json(text: str, max_depth: int) -> Any:
    """The decoded body; 400 for nesting deeper than ``max_depth`` or text that is not JSON, 400 or
    422 for a string holding a lone surrogate (:func:`check_unicode`)."""
    check_depth(text, max_depth)
    try:
        payload = json.loads(text)
    except ValueError as e:  # JSONDecodeError: its message names line and column, no internals
        raise BadRequest(400, f"body is not JSON: {e}") from None
    # UTF-8 text holds no surrogate: only a \uD800-\uDFFF escape makes one, so most bodies skip the walk.
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(payload)
    return payload


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _strings(value: Any, path: tuple) -> Any:
    """(path, string) for every string of a decoded body, keys included (a key's path ends in
    ``("key",)``); the body's depth is bounded by :func:`check_depth`."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key, "key"), key
            yield from _strings(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, (*path, i))


def check_unicode(payload: Any) -> None:
    """400 (422 inside a doc, naming it and the field) if a string or key of ``payload`` holds
    a lone UTF-16 surrogate: JSON allows ``"\\ud800"`` escapes, Unicode text does not."""
    for path, text in _strings(payload, ()):
        m = _SURROGATE.search(text)
        if m is not None:
            status, where = _where(payload, path)
            raise BadRequest(status, f"{where}lone UTF-16 surrogate \\u{ord(m.group()):04x} at character "
                             f"{m.start()}: not a Unicode character (send the character itself, or a high-low pair "
                             "of escapes for one beyond U+FFFF)")


def _where(payload: Any, path: tuple) -> tuple[int, str]:
    """(status, "doc i: field 'mentions[0]'" or "field 'k'") of the string at ``path`` in ``payload``."""
    doc, rest = None, path
    if isinstance(payload, list) and path:
        doc, rest = path[0], path[1:]
    elif isinstance(payload, dict) and "docs" not in payload:
        doc = 0
    elif path[:1] == ("docs",) and len(path) > 1:
        doc, rest = path[1], path[2:]
    key = rest[-2] if rest[-1:] == ("key",) else None
    if key is not None:
        rest = rest[:-2]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest).lstrip(".")
    what = (f"key {shown(key, 40)}" + (f" in field '{field}'" if field else "") if key is not None
            else f"field '{field}'" if field else "the value")
    return (400, f"{what}: ") if doc is None else (422, f"doc {doc}: {what}: ")


def request_docs(payload: Any, default_k: int) -> tuple[list, Any]:
    """The docs and (unchecked) k of a decoded body; 400 on a wrong shape.

    Forms: ``{"docs": [...], "k": 5}``, a list of docs, or one doc."""
    k = default_k
    if isinstance(payload, dict) and "docs" in payload:
        unknown = sorted(set(payload) - {"docs", "k"})
        if unknown:
            names = [u[:40] for u in unknown[:5]]  # check_unicode has seen them: no surrogate
            raise BadRequest(400, f"unknown request field(s) {names}; expected 'docs' and optionally 'k'")
        docs, k = payload["docs"], payload.get("k", default_k)
    elif isinstance(payload, dict):
        docs = [payload]
    else:
        docs = payload
    if not isinstance(docs, list):
        raise BadRequest(400, f"expected {{'docs': [...]}}, a list of docs or one doc; got {type(docs).__name__}")
    return docs, k


def _doc_spans(i: int, doc: Any, limits: Limits) -> int:
    """The number of spans ``doc`` asks to link, after checking the types and sizes that bound
    the work on it (422 for a type, 413 for a size)."""
    if not isinstance(doc, dict):
        raise BadRequest(422, f"doc {i}: expected an object with 'text' and 'mentions' (or a KILT 'input', or "
                              f"BLINK's 'mention' with its contexts), got {type(doc).__name__}")
    field = "text" if "text" in doc else "input" if "input" in doc else None
    if field is None and "mention" in doc:  # BLINK's mention line: one mention, its three texts bounded together
        texts = [doc.get(key, "") for key in BLINK_FIELDS]
        for key, text in zip(BLINK_FIELDS, texts):
            if not isinstance(text, str):
                raise BadRequest(422, f"doc {i}: field '{key}': expected a string, got {type(text).__name__}")
        size = sum(map(len, texts))
        if size > limits.max_text_chars:
            raise BadRequest(413, f"doc {i}: fields {', '.join(BLINK_FIELDS)}: {size} characters; the limit is "
                                  f"{limits.max_text_chars}")
        return 1
    if field is None:
        return 1  # no text: inputs.py names the missing field; nothing here to bound
    text = doc[field]
    if not isinstance(text, str):
        raise BadRequest(422, f"doc {i}: field '{field}': expected a string, got {type(text).__name__}")
    if len(text) > limits.max_text_chars:
        raise BadRequest(413, f"doc {i}: field '{field}': {len(text)} characters; the limit is "
                              f"{limits.max_text_chars}")
    if field == "input":
        n = text.count(START_ENT)
    else:
        spans = doc.get("mentions")
        if not isinstance(spans, list):
            return 1  # missing or not a list: inputs.py refuses it with the field's name
        n = len(spans)
    if n > limits.max_mentions_per_doc:
        raise BadRequest(413, f"doc {i}: {n} mentions; the limit per doc is {limits.max_mentions_per_doc}")
    if field == "text":
        for j, span in enumerate(doc["mentions"]):
            if not (isinstance(span, list) and len(span) == 2 and _is_int(span[0]) and _is_int(span[1])):
                raise BadRequest(422, f"doc {i}: field 'mentions[{j}]': expected [start, end] integers, "
                                      f"got {shown(span)}")
            # A span outside the text is inputs.py's to refuse (422), not a size.
            if 0 <= span[0] < span[1] <= len(text) and span[1] - span[0] > limits.max_span_chars:
                raise BadRequest(413, f"doc {i}: field 'mentions[{j}]': span of {span[1] - span[0]} characters; "
                                      f"the limit is {limits.max_span_chars}")
    return max(n, 1)


def check_k(k: Any, max_k: int) -> int:
    """k of the request: an integer of at least 1 (422 otherwise) no larger than ``max_k`` (413); the
    KB's size is the Linker's to check."""
    if not _is_int(k):
        raise BadRequest(422, f"field 'k': expected an integer, got {type(k).__name__}")
    if k < 1:
        raise BadRequest(422, f"field 'k': {k}; must be at least 1")
    if k > max_k:
        raise BadRequest(413, f"k = {k} entities per mention; the limit is {max_k}")
    return k


def check_request(payload: Any, default_k: int, limits: Limits) -> tuple[list, int]:
    """(docs, k) of a decoded body whose size, in every dimension the linker's work grows with,
    is within ``limits``; :class:`BadRequest` otherwise. Costs one pass over the docs and spans,
    no copies of the texts."""
    docs, k = request_docs(payload, default_k)
    k = check_k(k, limits.max_k)
    if len(docs) > limits.max_docs:
        raise BadRequest(413, f"{len(docs)} docs in one request; the limit is {limits.max_docs}")
    total = 0
    for i, doc in enumerate(docs):
        total += _doc_spans(i, doc, limits)
        if total > limits.max_mentions:  # the docs after this one would only add to it
            some = "" if i == len(docs) - 1 else "at least "
            raise BadRequest(413, f"{some}{total} mentions in one request; the limit is {limits.max_mentions}")
    return docs, k


class Deadline:
    """The time left of one request's budget, stage by stage (for asyncio.wait_for)."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._end = clock() + seconds

    @classmethod
    def until(cls, wall_end: float, seconds: float | None = None) -> "Deadline":
        """The deadline at wall-clock time ``wall_end`` (``time.time()``, set where the request
        arrived: the edge, on this machine or a clock-synchronised one)."""
        left = wall_end - time.time()
        deadline = cls(left)
        deadline.seconds = left if seconds is None else seconds
        return deadline

    def left(self) -> float:
        """Seconds left (>= 0)."""
        return max(0.0, self._end - self._clock())

    def timed_out(self, stage: str) -> BadRequest:
        """The 504 of a request whose budget ran out in ``stage``."""
        return BadRequest(504, f"request timed out after {self.seconds:g} s in {stage}")
