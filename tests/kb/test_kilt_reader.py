"""KILT knowledge source and KILT AIDA readers on lines written as the real files have them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_nce.core.records import BadRecord, BadRecordLog
from kb.kilt import iter_aida, iter_kilt_entities, parse_aida, parse_kilt_entity

FIXTURES = Path(__file__).parent / "fixtures"
KS = FIXTURES / "kilt_knowledgesource_sample.json"
AIDA_DEV = FIXTURES / "aidayago2-dev-kilt.jsonl"
AIDA_TEST = FIXTURES / "aidayago2-test_without_answers-kilt.jsonl"


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def ks_line(**override) -> str:
    page = {"_id": "5", "wikipedia_id": "5", "wikipedia_title": "Page", "text": ["Page\n", "Body.\n"],
            "anchors": [], "categories": "", "history": {"pageid": 5}}
    page.update(override)
    return json.dumps({k: v for k, v in page.items() if v is not ...})


def aida_line(**override) -> str:
    rec = {"id": "1", "input": "a [START_ENT] b [END_ENT] c",
           "output": [{"answer": "B", "provenance": [{"wikipedia_id": "7", "title": "B"}]}],
           "meta": {"left_context": "a", "mention": "b", "right_context": "c"}}
    rec.update(override)
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


# ---------------------------------------------------------------- knowledge source


def test_knowledge_source_fields():
    recs = list(iter_kilt_entities(KS))
    assert [(r.source_id, r.title, r.line) for r in recs] == [
        ("12", "Anarchism", 1), ("34061", "Zürich", 2), ("16815", "Kraków", 3)]
    # paragraphs 1.. stripped, empty ones dropped, joined by one space; paragraph 0 (title) excluded
    assert recs[0].description == (
        "Anarchism is an anti-authoritarian political philosophy that rejects hierarchies deemed unjust. "
        "Section::::Etymology. "
        'The word "anarchism" is composed from the word "anarchy" and the suffix -ism.')
    assert recs[1].description == "Zürich is the largest city in Switzerland."  # line without wikidata_info
    assert recs[2].description == ""  # title-only page
    assert all(r.world is None and r.path == str(KS) for r in recs)


def test_knowledge_source_is_streamed(tmp_path):
    path = write_lines(tmp_path / "ks.json", [ks_line(wikipedia_id=str(i)) for i in range(3)] + ["{broken"])
    it = iter_kilt_entities(path)
    assert next(it).source_id == "0"  # records arrive before the broken last line is read
    assert next(it).source_id == "1"


@pytest.mark.parametrize("line, reason", [
    # the column is where the cut line ends, not the newline after it (json's "line 2, column 1")
    ('{"_id": "5", "wikipedia_id": "5",', "not JSON (Expecting property name enclosed in double quotes at column 34)"),
    ('{"_id": "5', "not JSON (Unterminated string starting at column 9)"),
    ('["a", "list"]', "expected a JSON object, got list"),
    (ks_line(wikipedia_id=...), "missing field 'wikipedia_id'"),
    (ks_line(wikipedia_id=5), "field 'wikipedia_id': expected string, got number 5"),
    (ks_line(wikipedia_id="Q5"), "field 'wikipedia_id': expected a string of digits, got 'Q5'"),
    (ks_line(wikipedia_title=...), "missing field 'wikipedia_title'"),
    (ks_line(wikipedia_title=None), "field 'wikipedia_title': expected string, got null"),
    (ks_line(text="Page\nBody"), "field 'text': expected list"),
    (ks_line(text=[]), "field 'text': expected a non-empty list of paragraphs"),
    (ks_line(text=["Page\n", 3]), "field 'text[1]': expected string"),
])
def test_knowledge_source_bad_line_names_file_and_line(tmp_path, line, reason):
    path = write_lines(tmp_path / "kilt_knowledgesource.json", [ks_line(), ks_line(), line, ks_line()])
    with pytest.raises(BadRecord) as err:
        list(iter_kilt_entities(path))
    assert str(err.value).startswith(f"{path}:3: {reason}")
    assert (err.value.path, err.value.line) == (path, 3)


def test_skip_policy_counts_and_keeps_going(tmp_path):
    path = write_lines(tmp_path / "ks.json", [ks_line(wikipedia_id="1"), "not json", ks_line(wikipedia_id="x"),
                                              "", ks_line(wikipedia_id="4")])
    log = BadRecordLog("skip")
    assert [r.source_id for r in iter_kilt_entities(path, log)] == ["1", "4"]
    assert log.count == 2
    assert [(s["line"], s["reason"].split(" (")[0]) for s in log.skipped] == [
        (2, "not JSON"), (3, "field 'wikipedia_id': expected a string of digits, got 'x'")]


def test_invalid_utf8_is_a_bad_record_at_its_line(tmp_path):
    path = tmp_path / "ks.json"
    path.write_bytes(ks_line().encode() + b"\n" + b'{"wikipedia_title": "\xff"}\n')
    with pytest.raises(BadRecord, match=rf"^{path}:2: not UTF-8"):
        list(iter_kilt_entities(path))


def test_parse_kilt_entity_is_pure():
    rec = parse_kilt_entity(ks_line(text=["T\n", "  one  \n", "two"]), "x.json", 9)
    assert (rec.description, rec.path, rec.line) == ("one two", "x.json", 9)


# ---------------------------------------------------------------- AIDA


def test_aida_dev_lines():
    recs = list(iter_aida(AIDA_DEV))
    first, at_start, at_end = recs
    assert first.mention_id == "947testa CRICKET:0"
    assert first.left.endswith("took four for 38 on Friday as") and first.left.startswith("CRICKET - ")
    assert (first.mention, first.right) == ("Leicestershire", "beat Somerset by an innings and 39 runs in two days .")
    assert (first.gold_source_id, first.gold_title) == ("1622318", "Leicestershire County Cricket Club")
    # [START_ENT] is the first token of the input
    assert (at_start.left, at_start.mention, at_start.gold_source_id) == ("", "LONDON", "17867")
    assert at_start.right.startswith("1996-08-30")
    # [END_ENT] is the last token of the input; the title is unicode-escaped in the file
    assert (at_end.left, at_end.mention, at_end.right) == ("Striker Davor Šuker scored for", "Real Madrid", "")
    assert (at_end.world, at_end.category, at_end.line) == (None, None, 3)


def test_aida_test_file_without_answers_has_no_gold():
    (rec,) = list(iter_aida(AIDA_TEST))
    assert (rec.gold_source_id, rec.gold_title) == (None, None)
    assert rec.mention == "United Arab Emirates"
    assert rec.right.startswith("1996-12-06 Japan")


def test_aida_derivation_matches_meta_on_fixture_lines():
    for path in (AIDA_DEV, AIDA_TEST):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            meta = json.loads(line)["meta"]
            rec = parse_aida(line, str(path), lineno)
            assert (rec.left, rec.mention, rec.right) == (meta["left_context"], meta["mention"], meta["right_context"])


def test_aida_integer_id_and_marker_only_input():
    rec = parse_aida(aida_line(id=17, input="[START_ENT] Bonn [END_ENT]"), "a.jsonl", 1)
    assert (rec.mention_id, rec.left, rec.mention, rec.right) == ("17", "", "Bonn", "")


@pytest.mark.parametrize("line, reason", [
    ("{'id': 1}", "not JSON"),
    (aida_line(id=...), "missing field 'id'"),
    (aida_line(id=None), "field 'id': expected string or integer, got null"),
    (aida_line(input=...), "missing field 'input'"),
    (aida_line(input="no markers here"), "field 'input': expected exactly one [START_ENT] and one [END_ENT], found 0 and 0"),
    (aida_line(input="a [START_ENT] b [END_ENT] c [START_ENT] d"), "field 'input': expected exactly one [START_ENT]"),
    (aida_line(input="a [END_ENT] b [START_ENT] c"), "field 'input': [END_ENT] comes before [START_ENT]"),
    (aida_line(output=[]), "field 'output': expected a non-empty list of objects"),
    (aida_line(output=[{"provenance": [{"wikipedia_id": "7"}]}]), "missing field 'output[0].answer'"),
    (aida_line(output=[{"answer": "B", "provenance": []}]), "field 'output[0].provenance': expected a non-empty list"),
    (aida_line(output=[{"answer": "B", "provenance": [{"title": "B"}]}]),
     "missing field 'output[0].provenance[0].wikipedia_id'"),
    (aida_line(output=[{"answer": "B", "provenance": [{"wikipedia_id": 7}]}]),
     "field 'output[0].provenance[0].wikipedia_id': expected string, got number 7"),
    (aida_line(output=[{"answer": "B", "provenance": [{"wikipedia_id": "7a"}]}]),
     "field 'output[0].provenance[0].wikipedia_id': expected a string of digits, got '7a'"),
])
def test_aida_bad_line_names_file_and_line(tmp_path, line, reason):
    path = write_lines(tmp_path / "aidayago2-train-kilt.jsonl", [aida_line(), line])
    with pytest.raises(BadRecord) as err:
        list(iter_aida(path))
    assert str(err.value).startswith(f"{path}:2: {reason}")
