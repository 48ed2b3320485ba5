"""BLINK entity.jsonl reader: curid from the idx URL, file:line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_nce.core.records import BadRecord, BadRecordLog
from kb.blink import iter_blink_entities, parse_blink_entity

ENTITY_JSONL = Path(__file__).parent / "fixtures" / "entity.jsonl"


def entity_line(**override) -> str:
    rec = {"text": " Body text. ", "idx": "https://en.wikipedia.org/wiki?curid=42", "title": "T", "entity": "T"}
    rec.update(override)
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


def test_entity_jsonl_lines():
    anarchism, zurich = iter_blink_entities(ENTITY_JSONL)
    assert (anarchism.source_id, anarchism.title, anarchism.line) == ("12", "Anarchism", 1)
    assert anarchism.description == ("Anarchism is an anti-authoritarian political philosophy that rejects "
                                     "hierarchies deemed unjust.")
    assert (zurich.source_id, zurich.title, zurich.description) == (
        "34061", "Zürich", "Zürich is the largest city in Switzerland.")
    assert zurich.world is None and zurich.path == str(ENTITY_JSONL)


def test_curid_among_other_query_parameters_and_entity_optional():
    rec = parse_blink_entity(entity_line(idx="https://en.wikipedia.org/w/index.php?title=T&curid=7", entity=...),
                             "e.jsonl", 3)
    assert (rec.source_id, rec.line) == ("7", 3)


@pytest.mark.parametrize("line, reason", [
    ("", None),  # blank lines carry no record and are not errors
    ("{]", "not JSON"),
    (entity_line(text=...), "missing field 'text'"),
    (entity_line(title=["T"]), "field 'title': expected string, got list"),
    (entity_line(idx=42), "field 'idx': expected string, got number 42"),
    (entity_line(idx="https://en.wikipedia.org/wiki/Anarchism"),
     "field 'idx': expected a URL with one numeric curid=, got 'https://en.wikipedia.org/wiki/Anarchism'"),
    (entity_line(idx="https://en.wikipedia.org/wiki?curid=Q12"), "field 'idx': expected a URL with one numeric curid="),
    (entity_line(idx="https://en.wikipedia.org/wiki?curid=1&curid=2"),
     "field 'idx': expected a URL with one numeric curid="),
])
def test_bad_line_names_file_and_line(tmp_path, line, reason):
    path = tmp_path / "entity.jsonl"
    path.write_text(entity_line() + "\n" + line + "\n" + entity_line(), encoding="utf-8")  # no final newline
    if reason is None:
        assert len(list(iter_blink_entities(path))) == 2
        return
    with pytest.raises(BadRecord) as err:
        list(iter_blink_entities(path))
    assert str(err.value).startswith(f"{path}:2: {reason}")
    log = BadRecordLog("skip")
    assert [r.line for r in iter_blink_entities(path, log)] == [1, 3]
    assert log.skipped[0]["line"] == 2 and log.skipped[0]["reason"].startswith(reason)
