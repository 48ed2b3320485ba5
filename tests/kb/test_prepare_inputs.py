"""kb.prepare refuses inputs that parse but cannot be meant: empty sources and splits (unless
--allow-empty), and warns loudly, with counts, when a split's gold entities mostly miss."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dist_nce.core.records import BadRecord
from kb.jsonl import load_object
from kb.prepare import PrepareConfig, PrepareError, prepare
from tests.kb.test_prepare import aida_line, write_kilt

FIXTURES = Path(__file__).parent / "fixtures"


def _cfg(tmp_path: Path, model_dir: str, **kw) -> PrepareConfig:
    kw.setdefault("out", str(tmp_path / "kb"))
    return PrepareConfig(model_dir=model_dir, progress=False, **kw)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_knowledge_source_is_an_error_naming_it(tmp_path, tiny_model_dir, content):
    ks = tmp_path / "ks.json"
    ks.write_text(content)
    with pytest.raises(PrepareError, match=rf"(?s){ks.resolve()}: no entities.*--allow-empty"):
        prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(ks)), log=lambda s: None)
    assert not (tmp_path / "kb" / "manifest.json").exists()
    logs = []
    m = prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(ks), allow_empty=True), log=logs.append)
    assert m["entities"]["count"] == 0 and any("no entities" in w for w in m["warnings"])
    assert any(line.startswith("WARNING:") and str(ks.resolve()) in line for line in logs)


def test_a_split_whose_lines_are_all_skipped_is_empty_too(tmp_path, tiny_model_dir):
    write_kilt(tmp_path / "ks.json", 5)
    aida = tmp_path / "aida"
    aida.mkdir()
    (aida / "aidayago2-train-kilt.jsonl").write_text(aida_line("1", "x", "101", "X") + "\n")
    (aida / "aidayago2-dev-kilt.jsonl").write_text("not json\n")
    dev = (aida / "aidayago2-dev-kilt.jsonl").resolve()
    with pytest.raises(PrepareError, match=rf"{dev}: no mentions in split 'dev'"):
        prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(tmp_path / "ks.json"), aida_dir=str(aida),
                     on_bad_record="skip"), log=lambda s: None)


def test_an_empty_zeshel_split_is_an_error_naming_its_file(tmp_path, tiny_model_dir):
    root = tmp_path / "zeshel"
    shutil.copytree(FIXTURES / "zeshel", root)
    (root / "mentions" / "val.json").write_text("")
    with pytest.raises(PrepareError, match=rf"{(root / 'mentions' / 'val.json').resolve()}: no mentions in split 'val'"):
        prepare(_cfg(tmp_path, tiny_model_dir, zeshel_root=str(root)), log=lambda s: None)


def test_zeshel_tree_without_val_and_test_prepares_the_splits_it_has(tmp_path, tiny_model_dir):
    root = FIXTURES / "zeshel"  # documents of two worlds, mentions/train.json only
    logs = []
    m = prepare(_cfg(tmp_path, tiny_model_dir, zeshel_root=str(root)), log=logs.append)
    assert list(m["mentions"]) == ["train"]
    assert any("preparing the mention splits present (train); not found: val.json, test.json" in line
               for line in logs), logs
    with pytest.raises(FileNotFoundError, match=r"mentions: missing val.json \(named by --zeshel-splits; "
                                                r"present: train\)"):
        prepare(_cfg(tmp_path, tiny_model_dir, zeshel_root=str(root), zeshel_splits="train,val",
                     out=str(tmp_path / "other")), log=lambda s: None)


def test_low_gold_resolution_warns_loudly_and_is_recorded(tmp_path, tiny_model_dir):
    write_kilt(tmp_path / "ks.json", 10)  # wikipedia_id 100..109
    aida = tmp_path / "aida"
    aida.mkdir()
    lines = [aida_line(f"m{i}", "x", str(100 + i) if i < 6 else str(900 + i), "Nowhere") for i in range(10)]
    (aida / "aidayago2-train-kilt.jsonl").write_text("\n".join(lines) + "\n")
    logs = []
    m = prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(tmp_path / "ks.json"), aida_dir=str(aida)),
                log=logs.append)
    res = m["mentions"]["train"]["gold_resolution"]
    assert res == {"labelled": 10, "resolved": 6, "rate": 0.6, "threshold": 0.9, "below_threshold": True}
    loud = [line for line in logs if line.startswith("WARNING: mentions train")]
    assert len(loud) == 1 and "only 6 of 10 labelled mentions (60.0% < 90%)" in loud[0], logs
    assert m["warnings"] == [loud[0].removeprefix("WARNING: ")]

    logs.clear()
    m = prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(tmp_path / "ks.json"), aida_dir=str(aida),
                     min_gold_resolution=0.5, out=str(tmp_path / "lenient")), log=logs.append)
    assert m["warnings"] == [] and not any("WARNING" in line for line in logs)
    assert m["mentions"]["train"]["gold_resolution"]["below_threshold"] is False


def test_a_gold_title_several_entities_share_is_counted_and_an_unknown_aida_file_named(tmp_path, tiny_model_dir):
    from tests.kb.test_prepare import kilt_line

    # two pages titled Paris (the city, the Texas town): a gold without a known id resolves by title to the first
    pages = [kilt_line(100, "Paris", "capital of France"), kilt_line(101, "Paris", "a town in Texas"),
             kilt_line(102, "Lyon", "a city in France")]
    (tmp_path / "ks.json").write_text("\n".join(pages) + "\n")
    aida = tmp_path / "aida"
    aida.mkdir()
    lines = [aida_line("m0", "Paris", "100", "Paris"), aida_line("m1", "Paris", "999", "Paris"),
             aida_line("m2", "Lyon", "998", "Lyon")]
    (aida / "aidayago2-train-kilt.jsonl").write_text("\n".join(lines) + "\n")
    (aida / "aidayago2-test-kilt.jsonl").write_text(lines[0] + "\n")  # not KILT's name for the test split
    logs = []
    m = prepare(_cfg(tmp_path, tiny_model_dir, kilt_ks=str(tmp_path / "ks.json"), aida_dir=str(aida)),
                log=logs.append)
    train = m["mentions"]["train"]
    assert train["gold"] == {"id": 1, "title": 2, "missing": 0, "unlabelled": 0}
    assert train["ambiguous_title"] == {"count": 1, "mention_ids": ["m1"], "listed": 1}  # Lyon's title is unique
    loud = [line for line in logs if line.startswith("WARNING: mentions train")]
    assert len(loud) == 1 and "1 gold(s) found only by a title that several entities share" in loud[0], logs
    assert "mention ids m1;" in loud[0] and m["warnings"] == [loud[0].removeprefix("WARNING: ")]
    assert list(m["mentions"]) == ["train"]
    assert any(line.startswith(f"WARNING: {aida.resolve()}: not read: aidayago2-test-kilt.jsonl;") and
               "aidayago2-test_without_answers-kilt.jsonl" in line for line in logs), logs


def test_threshold_out_of_range_is_refused(tmp_path):
    with pytest.raises(PrepareError, match=r"min_gold_resolution: 1.5: must be in \[0, 1\]"):
        prepare(PrepareConfig(out=str(tmp_path / "kb"), kilt_ks="x", min_gold_resolution=1.5), log=lambda s: None)


def test_json_error_message_says_at_once():
    with pytest.raises(BadRecord) as e:
        load_object('{"a": "\x01"}', "f.json", 3)
    assert str(e.value) == "f.json:3: not JSON (Invalid control character at column 8)"
    with pytest.raises(BadRecord, match=r"not JSON \(Expecting ',' delimiter at column 8\)"):
        load_object('{"a": 1', "f.json", 3)


def test_a_byte_order_mark_opening_a_file_is_not_a_bad_record(tmp_path, tiny_model_dir):
    """Files saved by some Windows editors open with a UTF-8 BOM, which Python's json refuses: prepare read it
    as a malformed first line (an error, or under skip the first entity dropped). Both readers skip it: the
    chunked one (a chunk starting at byte 0; several chunks here) and the streaming one (AIDA). Only there:
    a BOM inside a file is still not JSON."""
    from kb.store import EntityStore, MentionTable

    write_kilt(tmp_path / "plain.json", 40)
    text = (tmp_path / "plain.json").read_text(encoding="utf-8")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    aida = tmp_path / "aida"
    aida.mkdir()
    (aida / "aidayago2-train-kilt.jsonl").write_bytes(
        b"\xef\xbb\xbf" + (aida_line("1", "x", "101", "X") + "\n" + aida_line("2", "y", "102", "Y") + "\n").encode())
    out = {}
    for name in ("plain", "bom"):
        out[name] = tmp_path / f"kb_{name}"
        prepare(_cfg(tmp_path, tiny_model_dir, out=str(out[name]), kilt_ks=str(tmp_path / f"{name}.json"),
                     aida_dir=str(aida), chunk_size="2K", min_gold_resolution=0.0), log=lambda s: None)
    plain, bom = EntityStore(out["plain"]), EntityStore(out["bom"])
    assert bom.num_entities == plain.num_entities == 40
    assert bom.source_ids(range(40)) == plain.source_ids(range(40))
    assert MentionTable(out["bom"], "train").mention_ids == ["1", "2"]
    lines = text.splitlines(keepends=True)
    (tmp_path / "inner.json").write_bytes("".join(lines[:3]).encode() + b"\xef\xbb\xbf" + "".join(lines[3:]).encode())
    with pytest.raises(BadRecord, match=r"inner\.json:4: not JSON \(Unexpected UTF-8 BOM"):
        prepare(_cfg(tmp_path, tiny_model_dir, out=str(tmp_path / "kb_inner"), kilt_ks=str(tmp_path / "inner.json"),
                     chunk_size="2K"), log=lambda s: None)
