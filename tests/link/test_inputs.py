"""Input forms and their refusals (pure)."""
from __future__ import annotations

import pytest

from dist_nce.link.inputs import parse_brackets, parse_docs


def test_spans_cut_left_mention_right():
    (a, b) = parse_docs([{"text": "Paris is in  France .", "mentions": [[13, 19], [0, 5]]}])
    assert (a.doc, a.span, a.record.left, a.record.mention, a.record.right) == (0, (13, 19), "Paris is in",
                                                                                  "France", ".")
    assert (b.record.left, b.record.mention, b.record.right) == ("", "Paris", "is in  France .")


def test_a_mention_holds_its_doc_text_not_copies_of_its_contexts():
    text = "Paris is in France . " * 2000
    mentions = parse_docs([{"text": text, "mentions": [[0, 5], [12, 18]]}])
    assert all(m.source is text for m in mentions)  # one text for every span, however many
    assert (mentions[1].mention, mentions[1].mention_id) == ("France", "0:1")
    r = mentions[1].record  # cut when asked for
    assert (r.left, r.mention, r.right) == ("Paris is in", "France", text[18:].strip())


def test_kilt_input_uses_the_kilt_reader_cut():
    (m,) = parse_docs([{"id": "q1", "input": "left side [START_ENT] Big Apple [END_ENT] right side"}])
    assert (m.span, m.record.mention_id, m.record.left, m.record.mention, m.record.right) == (
        None, "q1", "left side", "Big Apple", "right side")


def test_blink_mention_lines_are_cut_from_their_own_fields():
    # a line of BLINK's AIDA-YAGO2_testb.jsonl (scripts/create_BLINK_benchmark_data.py's fields)
    line = {"context_left": "SOCCER - JAPAN GET LUCKY WIN , ", "mention": "CHINA ",
            "context_right": " IN SURPRISE DEFEAT .", "query_id": "1163testb:3", "label_id": "887850",
            "Wikipedia_ID": "887850", "Wikipedia_URL": "http://en.wikipedia.org/wiki/China", "Wikipedia_title": "China"}
    (m,) = parse_docs([line])
    assert (m.doc, m.span, m.mention, m.mention_id) == (0, None, "CHINA", "1163testb:3")
    r = m.record
    assert (r.mention_id, r.left, r.mention, r.right) == ("1163testb:3", "SOCCER - JAPAN GET LUCKY WIN ,", "CHINA",
                                                          "IN SURPRISE DEFEAT .")
    # without query_id: the line's id, else its position; empty contexts are allowed (a mention at the start)
    (a, b) = parse_docs([{"id": 7, "mention": "x", "context_left": "", "context_right": ""},
                         {"mention": "y", "context_left": "", "context_right": "z"}])
    assert (a.mention_id, a.record.left, b.mention_id, b.record.right) == ("7", "", "1", "z")


@pytest.mark.parametrize("docs, needle", [
    ([{"text": "Paris"}], "doc 0: field 'mentions': missing"),
    ([{"text": "ok", "mentions": [[0, 1]]}, {"text": "Paris", "mentions": [[2, 9]]}],
     "doc 1: field 'mentions[0]': span [2, 9) is outside the text"),
    ([{"text": "Paris", "mentions": [[3, 3]]}], "doc 0: field 'mentions[0]'"),
    ([{"text": "Paris", "mentions": [[-1, 2]]}], "doc 0: field 'mentions[0]'"),
    ([{"text": "Paris", "mentions": [[0, True]]}], "expected [start, end] integers"),
    ([{"text": "a  b", "mentions": [[1, 3]]}], "holds only whitespace"),
    ([{"text": "   ", "mentions": [[0, 1]]}], "doc 0: field 'text': empty text"),
    ([{"text": 3, "mentions": [[0, 1]]}], "doc 0: field 'text': expected a string"),
    ([{"text": "Paris", "mentions": []}], "doc 0: field 'mentions': expected a non-empty list"),
    ([{"mentions": [[0, 1]]}], "doc 0: field 'text': missing"),
    ([{"text": "a", "mentions": [[0, 1]], "input": "x"}], "give one of 'text' + 'mentions', a KILT 'input', not"),
    ([{"input": "a [START_ENT] b [END_ENT]", "mention": "b"}], "a KILT 'input', BLINK's 'mention', not several"),
    ([{"mention": "Paris", "context_left": "a"}], "doc 0: field 'context_right': missing (a BLINK mention line"),
    ([{"mention": "Paris", "context_left": 3, "context_right": ""}], "field 'context_left': expected a string"),
    ([{"mention": " ", "context_left": "a", "context_right": "b"}], "doc 0: field 'mention': empty mention"),
    ([{"input": "no markers"}], "doc 0: field 'input': expected exactly one [START_ENT]"),
    ([{"input": "a [END_ENT] b [START_ENT] c"}], "doc 0: field 'input': [END_ENT] comes before"),
    (["Paris"], "doc 0: expected an object"),
    ([], "no documents"),
])
def test_bad_docs_name_the_doc_and_field(docs, needle):
    with pytest.raises(ValueError) as e:
        parse_docs(docs)
    assert needle in str(e.value)


def test_brackets():
    assert parse_brackets("Paris is in [France] and [Europe].") == {
        "text": "Paris is in France and Europe.", "mentions": [[12, 18], [23, 29]]}
    assert parse_brackets("a [START_ENT] b [END_ENT]") == {"input": "a [START_ENT] b [END_ENT]"}
    for bad, needle in (("no mention", "mark at least one"), ("a [b", "without ']'"), ("a] b", "without '['"),
                        ("[a [b]]", "nested")):
        with pytest.raises(ValueError) as e:
            parse_brackets(bad)
        assert needle in str(e.value)


def test_the_serve_config_is_loopback_and_its_args_are_a_serve_config():
    from pathlib import Path

    import yaml

    from dist_nce.core.config import ConfigError, from_dict
    from dist_nce.link.config import ServeConfig

    text = (Path(__file__).resolve().parents[2] / "configs" / "serve" / "link.yaml").read_text()
    cfg = yaml.safe_load(text)
    # Clients talk to the edge, on loopback; Serve's own proxy (whole bodies read, idle connections kept) is off.
    assert cfg["proxy_location"] == "Disabled" and "http_options" not in cfg
    (app,) = cfg["applications"]
    assert app["import_path"] == "dist_nce.link.serve:build_app"
    serve = from_dict(ServeConfig, app["args"])
    assert serve.link.k == 10 and (serve.edge_host, serve.edge_port, serve.route) == ("127.0.0.1", 8000, "/link")
    with pytest.raises(ConfigError, match="max_batch: unknown key"):
        from_dict(ServeConfig, {**app["args"], "max_batch": 3})


@pytest.mark.parametrize("doc, needle", [
    ({"text": "Par\ud800is", "mentions": [[0, 3]]}, "doc 0: field 'text': lone UTF-16 surrogate \\ud800 at character 3"),
    ({"input": "a [START_ENT] P\udc00 [END_ENT] b"}, "doc 0: field 'input': lone UTF-16 surrogate \\udc00"),
    ({"mention": "P", "context_left": "\udc00", "context_right": ""}, "field 'context_left': lone UTF-16 surrogate"),
])
def test_a_lone_surrogate_is_refused_before_the_tokenizer(doc, needle):
    # the Python API's own check (the tokenizer would raise a TypeError on it)
    with pytest.raises(ValueError) as e:
        parse_docs([doc])
    assert needle in str(e.value)
