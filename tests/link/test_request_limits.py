"""Request limits and checks of the Serve app, before any parsing work (pure; no Ray)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from dist_nce.link.request import (BadRequest, Deadline, Limits, check_depth, check_request, decode_utf8, parse_json,
                                   read_body)

LIMITS = Limits(max_request_bytes=1000, max_json_depth=6, max_docs=3, max_text_chars=50, max_mentions=5,
                max_mentions_per_doc=4, max_span_chars=10, max_k=20)


def refused(fn, *args) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        fn(*args)
    return e.value


async def _chunks(parts, pause: float = 0.0, seen: list | None = None):
    for p in parts:
        if pause:
            await asyncio.sleep(pause)
        if seen is not None:
            seen.append(len(p))
        yield p


def read(parts, declared=None, max_bytes=1000, timeout=5.0, pause=0.0, seen=None) -> bytes:
    return asyncio.run(read_body(_chunks(parts, pause, seen), declared, max_bytes, timeout))


def test_read_body_joins_the_stream():
    assert read([b'{"a"', b": 1}"], declared="9") == b'{"a": 1}'
    assert read([b"x" * 1000]) == b"x" * 1000  # exactly the limit


def test_read_body_stops_at_the_limit_without_a_length():
    seen: list[int] = []
    with pytest.raises(BadRequest) as e:
        read([b"x" * 400] * 1000, max_bytes=1000, seen=seen)  # a 400 kB chunked body
    assert (e.value.status, "the limit is 1000" in e.value.message) == (413, True)
    assert sum(seen) == 1200  # read up to the first chunk past the limit, no further


def test_read_body_refuses_a_declared_length_before_reading():
    seen: list[int] = []
    with pytest.raises(BadRequest) as e:
        read([b"x"] * 10, declared="10000000", seen=seen)
    assert e.value.status == 413 and "body of 10000000 bytes; the limit is 1000" in e.value.message and seen == []
    with pytest.raises(BadRequest) as e:
        read([b"x"], declared="12; drop table")
    assert e.value.status == 400 and "Content-Length" in e.value.message


def test_read_body_gives_a_slow_client_408():
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as e:
        read([b"x"] * 100, timeout=0.2, pause=0.05)
    assert e.value.status == 408 and "within 0.2 s" in e.value.message
    assert time.perf_counter() - t0 < 2


def test_utf8_is_strict_and_names_the_offset():
    assert decode_utf8('{"text": "Zürich"}'.encode()) == '{"text": "Zürich"}'
    e = refused(decode_utf8, b'{"text": "ab\xffcd"}')
    assert e.status == 400 and "byte 0xff at offset 12" in e.message
    e = refused(decode_utf8, b'{"t": "\xc3"}')  # a truncated sequence
    assert e.status == 400 and "offset 7" in e.message


def test_depth_is_checked_before_decoding():
    check_depth('{"docs": [{"text": "[[[[[[[[[[", "mentions": [[0, 1]]}]}', 5)  # brackets in strings don't count
    check_depth('["a\\"[[[[[[[[[", 1]', 1)  # nor after an escaped quote
    e = refused(check_depth, '{"docs": [{"text": "a", "mentions": [[0, 1]]}]}', 4)
    assert e.status == 400 and "nested deeper than 4 levels (at character 37)" in e.message
    e = refused(check_depth, "[" * 100_000 + "]" * 100_000, 6)
    assert e.status == 400 and "nested deeper than 6" in e.message
    # a body deep enough to exhaust json.loads' recursion is a 400, not a RecursionError
    e = refused(parse_json, "[" * 200_000, 16)
    assert e.status == 400 and "nested deeper than 16" in e.message
    e = refused(parse_json, '{"docs": [', 16)
    assert e.status == 400 and "body is not JSON" in e.message
    assert parse_json('{"k": [[1]]}', 3) == {"k": [[1]]}


def good(n_docs=1, spans=((0, 5),), text="Paris is in France .") -> dict:
    return {"docs": [{"text": text, "mentions": [list(s) for s in spans]} for _ in range(n_docs)], "k": 3}


def test_a_request_within_the_limits_passes():
    docs, k = check_request(good(3), 10, LIMITS)
    assert (len(docs), k) == (3, 3)
    docs, k = check_request({"input": "a [START_ENT] b [END_ENT] c"}, 10, LIMITS)
    assert (docs, k) == ([{"input": "a [START_ENT] b [END_ENT] c"}], 10)
    docs, k = check_request([{"text": "Paris", "mentions": [[0, 5]]}], 7, LIMITS)
    assert k == 7
    blink = {"context_left": "x" * 30, "mention": "m", "context_right": "y" * 19}  # 50 characters in all
    assert check_request([blink], 7, LIMITS) == ([blink], 7)


@pytest.mark.parametrize("payload, status, needle", [
    (good(4), 413, "4 docs in one request; the limit is 3"),
    (good(text="x" * 51), 413, "doc 0: field 'text': 51 characters; the limit is 50"),
    ({"docs": [{"input": "x" * 60}]}, 413, "doc 0: field 'input': 60 characters"),
    # BLINK's mention line: its three texts count together against the text limit
    ({"docs": [{"context_left": "x" * 30, "mention": "m", "context_right": "y" * 20}]}, 413,
     "doc 0: fields context_left, mention, context_right: 51 characters; the limit is 50"),
    ({"docs": [{"context_left": 3, "mention": "m", "context_right": ""}]}, 422,
     "doc 0: field 'context_left': expected a string, got int"),
    (good(spans=[(0, 1)] * 5), 413, "doc 0: 5 mentions; the limit per doc is 4"),
    ({"docs": [{"input": "[START_ENT] a [END_ENT] " * 2}] * 3}, 413, "6 mentions in one request; the limit is 5"),
    (good(3, spans=[(0, 1)] * 3), 413, "at least 6 mentions in one request; the limit is 5"),
    (good(2, spans=[(0, 1)] * 3), 413, "6 mentions in one request; the limit is 5"),
    (good(text="x" * 20, spans=[(0, 11)]), 413, "doc 0: field 'mentions[0]': span of 11 characters; the limit is 10"),
    ({**good(), "k": 10 ** 7}, 413, "k = 10000000 entities per mention; the limit is 20"),
    ({**good(), "k": 0}, 422, "field 'k': 0; must be at least 1"),
    ({**good(), "k": -3}, 422, "field 'k': -3; must be at least 1"),
    ({**good(), "k": True}, 422, "field 'k': expected an integer, got bool"),
    ({**good(), "k": "3"}, 422, "field 'k': expected an integer, got str"),
    ({**good(), "k": 3.0}, 422, "field 'k': expected an integer, got float"),
    ({"docs": [{"text": 3, "mentions": [[0, 1]]}]}, 422, "doc 0: field 'text': expected a string, got int"),
    ({"docs": [{"text": "ok", "mentions": [[0, 1]]}, {"text": "ok", "mentions": [[0, "1"]]}]}, 422,
     "doc 1: field 'mentions[0]': expected [start, end] integers"),
    ({"docs": [{"text": "ok", "mentions": [[0, True]]}]}, 422, "expected [start, end] integers"),
    ({"docs": [{"text": "ok", "mentions": [[0, 1, 2]]}]}, 422, "expected [start, end] integers"),
    ({"docs": ["Paris"]}, 422, "doc 0: expected an object"),
    ({"docs": "Paris"}, 400, "expected {'docs': [...]}"),
    ({"docs": [], "kk": 3}, 400, "unknown request field(s) ['kk']"),
    (3, 400, "got int"),
])
def test_refusals_name_the_field_and_limit(payload, status, needle):
    e = refused(check_request, payload, 10, LIMITS)
    assert (e.status, needle in e.message) == (status, True), e.message


def test_huge_span_counts_are_refused_without_walking_them():
    # 1,000,000 spans: refused by the per-doc count (len of the list), not span by span
    payload = {"docs": [{"text": "x" * 50, "mentions": [[0, 1]] * 1_000_000}]}
    t0 = time.perf_counter()
    e = refused(check_request, payload, 10, LIMITS)
    assert e.status == 413 and "1000000 mentions" in e.message
    assert time.perf_counter() - t0 < 0.5


def test_what_inputs_checks_is_left_to_it():
    # missing fields, spans outside the text: inputs.py refuses them later with the same naming
    for payload in ({"docs": [{"text": "Paris"}]}, {"docs": [{"text": "Paris", "mentions": [[3, 40]]}]},
                    {"docs": [{"mentions": [[0, 1]]}]}):
        docs, _ = check_request(payload, 10, LIMITS)
        assert docs == payload["docs"]


def test_deadline_names_the_stage():
    now = [100.0]
    d = Deadline(2.5, clock=lambda: now[0])
    assert d.left() == 2.5
    now[0] = 103.0
    assert d.left() == 0.0
    e = d.timed_out("search")
    assert (e.status, e.message) == (504, "request timed out after 2.5 s in search")


def test_within_turns_a_slow_stage_into_504():
    from dist_nce.link.serve import within

    async def slow():
        await asyncio.sleep(5)

    async def run():
        return await within(Deadline(0.05), "search", slow())

    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as e:
        asyncio.run(run())
    assert (e.value.status, e.value.message) == (504, "request timed out after 0.05 s in search")
    assert time.perf_counter() - t0 < 2
    assert asyncio.run(within(Deadline(5), "encode", asyncio.sleep(0, result=7))) == 7


def test_messages_hold_no_request_text_beyond_a_bound():
    e = refused(check_request, {"docs": [{"text": "ok", "mentions": [["x" * 10_000, 1]]}]}, 10, LIMITS)
    assert len(e.message) < 200
    e = refused(check_request, {"docs": [], "k" * 5000: 1}, 10, LIMITS)
    assert len(e.message) < 200
    assert json.dumps({"error": e.message})


@pytest.mark.parametrize("body, status, needle", [
    ('{"docs": [{"text": "Par\\ud800is", "mentions": [[0, 3]]}]}', 422,
     "doc 0: field 'text': lone UTF-16 surrogate \\ud800 at character 3"),
    ('[{"text": "ok", "mentions": [[0, 1]]}, {"id": "\\udc00", "input": "a [START_ENT] b [END_ENT]"}]', 422,
     "doc 1: field 'id': lone UTF-16 surrogate \\udc00 at character 0"),
    ('{"input": "a [START_ENT] \\ude00\\ud83d [END_ENT]"}', 422, "doc 0: field 'input': lone UTF-16 surrogate \\ude00"),
    ('{"docs": [{"text": "ok", "mentions": [["\\ud800", 1]]}]}', 422, "doc 0: field 'mentions[0][0]': lone"),
    ('{"docs": [{"text": "ok", "mentions": [[0, 1]], "\\ud800x": 1}]}', 422, 'doc 0: key "\\ud800x": lone'),
    ('{"docs": [], "k": "\\udfff"}', 400, "field 'k': lone UTF-16 surrogate \\udfff"),
])
def test_a_lone_surrogate_is_refused_naming_the_field(body, status, needle):
    e = refused(parse_json, body, 16)
    assert (e.status, needle in e.message) == (status, True), e.message
    assert json.dumps({"error": e.message}, ensure_ascii=False).encode("utf-8")  # writable as UTF-8


def test_a_surrogate_pair_is_a_character():
    docs, _ = check_request(parse_json('{"docs": [{"text": "\\ud83d\\ude00 Paris", "mentions": [[2, 7]]}]}', 16),
                            10, LIMITS)
    assert docs[0]["text"] == "\U0001F600 Paris"


def test_a_refusal_never_echoes_a_large_value():
    from dist_nce.link.inputs import parse_docs
    from dist_nce.link.request import MAX_MESSAGE, shown

    with pytest.raises(ValueError) as e:
        parse_docs([{"text": "ab", "mentions": "x" * 900_000}])
    assert len(str(e.value)) < 200 and "900000 characters" in str(e.value)
    assert len(shown("x" * 900_000)) < 100 and len(BadRequest(422, "y" * 900_000).message) <= MAX_MESSAGE
