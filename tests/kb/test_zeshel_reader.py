"""Zeshel documents and mentions: inclusive whitespace-token indices, file:line errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_nce.core.records import BadRecord, BadRecordLog
from kb.zeshel import (
    ZESHEL_SPLITS,
    ZESHEL_WORLDS,
    iter_zeshel_documents,
    iter_zeshel_mentions,
    load_zeshel_documents_text,
    parse_zeshel_mention,
    worlds_for_split,
)

ROOT = Path(__file__).parent / "fixtures" / "zeshel"

DOC = "w0 w1 w2 w3 w4"


def mention_line(**override) -> str:
    rec = {"mention_id": "M1", "context_document_id": "D1", "corpus": "lego", "start_index": 1, "end_index": 2,
           "text": "w1 w2", "label_document_id": "D2", "category": "MULTIPLE_CATEGORIES"}
    rec.update(override)
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


def make_root(tmp_path: Path, mention_lines: list[str], docs: dict[str, list[dict]] | None = None) -> Path:
    docs = docs if docs is not None else {"lego": [{"document_id": "D1", "title": "w0", "text": DOC}]}
    for world, lines in docs.items():
        (tmp_path / "documents").mkdir(parents=True, exist_ok=True)
        (tmp_path / "documents" / f"{world}.json").write_text("".join(json.dumps(d) + "\n" for d in lines))
    (tmp_path / "mentions").mkdir(parents=True, exist_ok=True)
    (tmp_path / "mentions" / "train.json").write_text("".join(line + "\n" for line in mention_lines))
    return tmp_path


def test_worlds_and_splits():
    assert ZESHEL_WORLDS["train"] == ["american_football", "doctor_who", "fallout", "final_fantasy", "military",
                                      "pro_wrestling", "starwars", "world_of_warcraft"]
    assert ZESHEL_WORLDS["val"] == ["coronation_street", "elder_scrolls", "ice_hockey", "muppets"]
    assert ZESHEL_WORLDS["test"] == ["forgotten_realms", "lego", "star_trek", "yugioh"]
    assert sum(map(len, ZESHEL_WORLDS.values())) == 16
    assert ZESHEL_SPLITS == ("train", "val", "test", "heldout_train_seen", "heldout_train_unseen")
    assert worlds_for_split("heldout_train_unseen") == ZESHEL_WORLDS["train"]
    assert worlds_for_split("val") == ZESHEL_WORLDS["val"]
    with pytest.raises(ValueError, match="unknown Zeshel split 'dev'"):
        worlds_for_split("dev")


def test_documents_keep_text_whole_and_world_is_file_stem():
    recs = list(iter_zeshel_documents(ROOT))  # every documents/*.json, sorted: military, starwars
    assert [(r.world, r.source_id, r.title) for r in recs] == [
        ("military", "F2845988E1AC5BC0", "Jessen-Schmidt"), ("military", "33B704F9C31B1D57", "C. W. Jessen"),
        ("starwars", "88798F9F1493965A", "Nerva Beacon"), ("starwars", "000523A4D586C293", "Warner")]
    assert recs[3].description == "Warner Warner was a communications technician aboard Nerva Beacon ..."
    assert recs[0].description.endswith("the Königsberg .")
    assert [r.world for r in iter_zeshel_documents(ROOT, ["starwars"])] == ["starwars", "starwars"]


def test_missing_world_file_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="lego.json"):
        list(iter_zeshel_documents(ROOT, ["starwars", "lego"]))


def test_mentions_cut_by_inclusive_whitespace_token_indices():
    warner, jessen, nerva = list(iter_zeshel_mentions(ROOT, "train"))
    # start_index == end_index == 9: a one-token mention (inclusive end)
    assert (warner.left, warner.mention) == ("Nerva Beacon Nerva Beacon was a space station .", "Warner")
    assert warner.right == "was a communications technician aboard Nerva Beacon ."
    assert (warner.gold_source_id, warner.gold_title, warner.world, warner.category) == (
        "000523A4D586C293", None, "starwars", "LOW_OVERLAP")
    # [1, 5] covers five whitespace tokens of "Jessen-Schmidt C . W . Jessen commanded ..."
    assert (jessen.left, jessen.mention, jessen.right) == ("Jessen-Schmidt", "C . W . Jessen", "commanded the Königsberg .")
    # mention at the very start of its context document
    assert (nerva.left, nerva.mention, nerva.line) == ("", "Nerva Beacon", 3)
    assert nerva.path == str(ROOT / "mentions" / "train.json")


def test_mention_at_document_end_and_irregular_whitespace(tmp_path):
    docs = {"lego": [{"document_id": "D1", "title": "t", "text": "w0  w1\nw2\tw3 w4 "}]}
    root = make_root(tmp_path, [mention_line(start_index=3, end_index=4, text="w3 w4")], docs)
    (rec,) = iter_zeshel_mentions(root, "train")
    assert (rec.left, rec.mention, rec.right) == ("w0 w1 w2", "w3 w4", "")


def test_only_context_documents_are_loaded():
    texts = load_zeshel_documents_text(ROOT, ["starwars", "military"], only={"88798F9F1493965A"})
    assert list(texts) == ["88798F9F1493965A"]


def test_explicit_documents_mapping_is_used(tmp_path):
    root = make_root(tmp_path, [mention_line()], docs={})
    (rec,) = iter_zeshel_mentions(root, "train", documents={"D1": "x w1 w2 y"})
    assert (rec.left, rec.mention, rec.right) == ("x", "w1 w2", "y")


def test_category_is_optional():
    rec = parse_zeshel_mention(mention_line(category=...), "m.json", 1, {"D1": DOC})
    assert rec.category is None


@pytest.mark.parametrize("line, reason", [
    ("not json", "not JSON"),
    (mention_line(start_index=...), "missing field 'start_index'"),
    (mention_line(start_index="1"), "field 'start_index': expected integer, got string '1'"),
    (mention_line(end_index=2.0), "field 'end_index': expected integer, got number 2.0"),
    (mention_line(end_index=True), "field 'end_index': expected integer, got boolean"),
    (mention_line(label_document_id=...), "missing field 'label_document_id'"),
    (mention_line(context_document_id="NOPE"), "context document 'NOPE' (corpus 'lego') not found in "
                                               "documents/lego.json"),
    (mention_line(start_index=4, end_index=5, text="w4"),
     "indices [4, 5] (inclusive) outside context document 'D1' of 5 whitespace tokens"),
    (mention_line(start_index=-1, end_index=0, text="w0"), "indices [-1, 0] (inclusive) outside"),
    (mention_line(start_index=3, end_index=2, text=""), "indices [3, 2] (inclusive) outside"),
    (mention_line(text="w1"), "field 'text' 'w1' differs from tokens [1, 2] of 'D1': 'w1 w2'"),
])
def test_bad_mention_names_mentions_file_and_line(tmp_path, line, reason):
    root = make_root(tmp_path, [mention_line(), line, mention_line()])
    path = root / "mentions" / "train.json"
    with pytest.raises(BadRecord) as err:
        list(iter_zeshel_mentions(root, "train"))
    assert str(err.value).startswith(f"{path}:2: {reason}")


def test_mention_whose_world_has_no_documents_file(tmp_path):
    root = make_root(tmp_path, [mention_line(), mention_line(corpus="yugioh", context_document_id="Y1")])
    with pytest.raises(BadRecord, match=r"train\.json:2: corpus 'yugioh' has no documents/yugioh\.json beside "
                                        r"mentions/$"):
        list(iter_zeshel_mentions(root, "train"))
    # also when its context document exists in another world's file (it passed, and evaluation failed after
    # the whole training run: that world has no entities)
    root = make_root(tmp_path / "other", [mention_line(), mention_line(corpus="yugioh")])
    with pytest.raises(BadRecord, match=r"train\.json:2: corpus 'yugioh' has no documents/yugioh\.json"):
        list(iter_zeshel_mentions(root, "train"))


def test_mention_whose_context_document_is_in_another_world(tmp_path):
    docs = {"lego": [{"document_id": "D1", "title": "w0", "text": DOC}],
            "muppets": [{"document_id": "D9", "title": "w0", "text": DOC}]}
    root = make_root(tmp_path, [mention_line(), mention_line(corpus="muppets")], docs)
    with pytest.raises(BadRecord, match=r"train\.json:2: context document 'D1' \(corpus 'muppets'\) not found in "
                                        r"documents/muppets\.json"):
        list(iter_zeshel_mentions(root, "train"))


def test_skip_policy_keeps_good_mentions(tmp_path):
    root = make_root(tmp_path, [mention_line(mention_id="a"), mention_line(mention_id="b", end_index=9),
                                "{", mention_line(mention_id="c", start_index=0, end_index=0, text="w0")])
    log = BadRecordLog("skip")
    assert [m.mention_id for m in iter_zeshel_mentions(root, "train", log)] == ["a", "c"]
    assert [s["line"] for s in log.skipped] == [2, 3]


@pytest.mark.parametrize("doc_line, reason", [
    ('{"document_id": "D9", "title": "t"}', "missing field 'text'"),
    ('{"document_id": 9, "title": "t", "text": "t"}', "field 'document_id': expected string, got number 9"),
])
def test_bad_document_line(tmp_path, doc_line, reason):
    root = make_root(tmp_path, [mention_line()])
    path = root / "documents" / "lego.json"
    path.write_text(path.read_text() + doc_line + "\n")
    with pytest.raises(BadRecord) as err:
        list(iter_zeshel_documents(root))
    assert str(err.value).startswith(f"{path}:2: {reason}")


def test_duplicate_document_id_is_reported(tmp_path):
    dup = {"document_id": "D1", "title": "again", "text": "again"}
    root = make_root(tmp_path, [mention_line()], {"lego": [{"document_id": "D1", "title": "w0", "text": DOC}, dup]})
    with pytest.raises(BadRecord, match=r"lego\.json:2: duplicate document_id 'D1'"):
        load_zeshel_documents_text(root, ["lego"])


def test_missing_split_file(tmp_path):
    shutil.copytree(ROOT, tmp_path / "z")
    with pytest.raises(FileNotFoundError, match="split 'val'"):
        iter_zeshel_mentions(tmp_path / "z", "val")
