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
* :func:`check_request`: the docs and k of the decoded body: shape and types (400 for the
  body's, 422 for a doc's, naming the doc and field) and the limits (413) on docs, text
  length, spans per doc and in all, span length and k.

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

from kb.kilt import START_ENT


class BadRequest(Exception):
    """A refused request: the HTTP ``status`` and the ``message`` the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


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
    """The decoded body; 400 for nesting deeper than ``max_depth`` or text that is not JSON."""
    check_depth(text, max_depth)
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError: its message names line and column, no internals
        raise BadRequest(400, f"body is not JSON: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def request_docs(payload: Any, default_k: int) -> tuple[list, Any]:
    """The docs and (unchecked) k of a decoded body; 400 on a wrong shape.

    Forms: ``{"docs": [...], "k": 5}``, a list of docs, or one doc."""
    k = default_k
    if isinstance(payload, dict) and "docs" in payload:
        unknown = sorted(set(payload) - {"docs", "k"})
        if unknown:
            shown = [u[:40] for u in unknown[:5]]
            raise BadRequest(400, f"unknown request field(s) {shown}; expected 'docs' and optionally 'k'")
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
        raise BadRequest(422, f"doc {i}: expected an object with 'text' and 'mentions' (or a KILT 'input'), "
                              f"got {type(doc).__name__}")
    field = "text" if "text" in doc else "input" if "input" in doc else None
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
                shown = json.dumps(span)[:60]
                raise BadRequest(422, f"doc {i}: field 'mentions[{j}]': expected [start, end] integers, got {shown}")
            # A span outside the text is inputs.py's to refuse (422), not a size.
            if 0 <= span[0] < span[1] <= len(text) and span[1] - span[0] > limits.max_span_chars:
                raise BadRequest(413, f"doc {i}: field 'mentions[{j}]': span of {span[1] - span[0]} characters; "
                                      f"the limit is {limits.max_span_chars}")
    return max(n, 1)


def check_k(k: Any, max_k: int) -> int:
    """k of the request: an integer (422 otherwise) no larger than ``max_k`` (413); the lower bound
    and the KB's size are the Linker's to check."""
    if not _is_int(k):
        raise BadRequest(422, f"field 'k': expected an integer, got {type(k).__name__}")
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

    def left(self) -> float:
        """Seconds left (>= 0)."""
        return max(0.0, self._end - self._clock())

    def timed_out(self, stage: str) -> BadRequest:
        """The 504 of a request whose budget ran out in ``stage``."""
        return BadRequest(504, f"request timed out after {self.seconds:g} s in {stage}")
