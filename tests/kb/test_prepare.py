"""kb.prepare / kb.ingest / kb.assemble: chunking, resumption, bad-record policies, gold resolution.

Inputs are written here line by line exactly as the real files look (KILT knowledge
source, KILT AIDA, Zeshel documents/mentions, BLINK entity.jsonl).
"""
from __future__ import annotations

import functools
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dist_nce.core.records import BadRecord, BadRecordLog
from dist_nce.core.text import encode_entity, encode_mention, load_tokenizer
from kb.ingest import (ChunkTask, RangeRecords, count_newlines, file_fingerprint, output_path, plan_byte_ranges,
                       run_chunks, write_marker)
from kb.prepare import PrepareConfig, PrepareError, parse_size, prepare, summarize
from kb.store import EntityStore, MentionTable, read_arrow, write_arrow

QUIET = {"log": lambda s: None}
WORDS = "river north castle album band film league station county party war song".split()


def kilt_line(wid: int, title: str, body: str) -> str:
    return json.dumps({"_id": str(wid + 7), "wikipedia_id": str(wid), "wikipedia_title": title,
                       "text": [title + "\n", body + "\n", "Section::::See also.\n"],
                       "anchors": [{"text": "x", "href": "X", "paragraph_id": 1, "start": 0, "end": 1}],
                       "categories": "Living people,Stubs", "history": {"revid": wid, "pageid": wid},
                       "wikidata_info": {"wikidata_id": f"Q{wid}"}})


def write_kilt(path: Path, n: int, seed: int = 0, replace: dict[int, str] | None = None) -> list[tuple[int, str]]:
    """n entities (wikipedia_id 100+i); ``replace`` maps a 1-based line number to raw text."""
    rng = random.Random(seed)
    pages, lines = [], []
    for i in range(n):
        title = f"{rng.choice(WORDS).title()} {i}"
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))
        pages.append((100 + i, title))
        lines.append(kilt_line(100 + i, title, body))
    for lineno, raw in (replace or {}).items():
        lines[lineno - 1] = raw
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return pages


def aida_line(mid: str, mention: str, wid: str | None, title: str | None) -> str:
    obj = {"id": mid, "input": f"EU rejects German call [START_ENT] {mention} [END_ENT] to boycott lamb .",
           "meta": {"left_context": "EU rejects German call", "mention": mention, "right_context": "to boycott lamb ."}}
    if wid is not None:
        obj["output"] = [{"answer": title, "provenance": [{"wikipedia_id": wid, "title": title}]}]
    return json.dumps(obj)


def cfg(tmp: Path, **kw) -> PrepareConfig:
    kw.setdefault("progress", False)
    return PrepareConfig(out=str(tmp / kw.pop("name", "out")), **kw)


def all_rows(out: Path) -> list[dict]:
    m = json.loads((out / "manifest.json").read_text())
    rows = []
    for part in m["entities"]["parts"]:
        rows += read_arrow(out / "entities" / part).to_pylist()
    return rows


def mention_rows(out: Path, split: str) -> list[dict]:
    return read_arrow(out / "mentions" / split / "mentions.arrow").to_pylist()


# --------------------------------------------------------------------------- byte ranges


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_byte_ranges_cover_file_at_line_starts(tmp_path, chunk, trailing_newline):
    lines = [("x" * random.Random(i).randint(0, 30)) for i in range(40)]
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    path = tmp_path / "f.jsonl"
    path.write_bytes(text.encode())
    ranges = plan_byte_ranges(path, chunk)
    data = path.read_bytes()
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a < b and b == c for (a, b), (c, _) in zip(ranges, ranges[1:]))
    assert all(data[a - 1:a] == b"\n" for a, _ in ranges[1:])
    # Every line is read exactly once, with local numbers that add up to global ones.
    seen, base = [], 0
    for a, b in ranges:
        reader = RangeRecords(str(path), a, b, lambda line, p, n: (n, line.rstrip("\n")), BadRecordLog())
        seen += [(base + n, s) for n, s in reader]
        assert base == count_newlines(path, 0, a)
        base += reader.lines
    assert seen == [(i + 1, s) for i, s in enumerate(lines) if s.strip()]


def test_empty_file_has_no_ranges(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    assert plan_byte_ranges(tmp_path / "e", 10) == []


def test_fingerprint_changes_with_content(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"a" * 300_000)
    fp = file_fingerprint(p)
    p.write_bytes(b"a" * 299_999 + b"b")
    assert file_fingerprint(p)["sample_sha256"] != fp["sample_sha256"]
    assert fp["size"] == 300_000


def test_parse_size():
    assert parse_size("32M") == 32 << 20 and parse_size("1.5K") == 1536 and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="chunk_size"):
        parse_size("lots")


def _tagged_chunk(task: ChunkTask, work_dir: str) -> dict:
    """A stand-in chunk worker (no tokenizer): lines tagged BAD are malformed, SLOW sleeps."""
    def parse(line: str, path: str, n: int) -> str:
        if "BAD" in line:
            raise BadRecord(path, n, "tagged bad")
        return line

    records = RangeRecords(task.path, task.start, task.end, parse, BadRecordLog("error"))
    try:
        rows = list(records)
    except BadRecord as e:
        if "SLOW" in Path(task.path).read_bytes()[task.start:task.end].decode():
            time.sleep(1.0)  # report late, after a later chunk has failed
        return {"bad": {"path": e.path, "line": e.line, "reason": e.reason}}
    write_arrow(output_path(work_dir, task), pa.table({"line": rows}))
    return write_marker(work_dir, task, "run", {"rows": len(rows), "lines": records.lines, "skipped_count": 0,
                                                "skipped": []})


def test_parallel_error_is_the_earliest_bad_line(tmp_path):
    tags = {3: "SLOW", 5: "BAD", 15: "BAD", 95: "BAD"}
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(f"{i:04d} {tags.get(i, ''):<4}\n" for i in range(1, 121)))  # 10 bytes a line
    tasks = [ChunkTask(f"c{k:02d}", "entities", "tagged", str(path), a, b, weight=b - a, spec={"k": k})
             for k, (a, b) in enumerate(plan_byte_ranges(path, 100))]
    assert len(tasks) == 12
    fn = functools.partial(_tagged_chunk, work_dir=str(tmp_path / "work"))
    with pytest.raises(BadRecord) as e:
        run_chunks(tasks, tmp_path / "work", fn, workers=2, progress=False, log=lambda s: None)
    assert (e.value.path, e.value.line) == (str(path), 5)  # not line 15, which failed first
    with pytest.raises(BadRecord, match=r"tagged.jsonl:95: tagged bad"):  # global line in chunk 9
        run_chunks(tasks[2:], tmp_path / "work", fn, workers=1, progress=False, log=lambda s: None)
    assert {p.stem for p in (tmp_path / "work").glob("*.json")} >= {f"c{k:02d}" for k in range(2, 9)}


# --------------------------------------------------------------------------- KILT + AIDA


@pytest.fixture(scope="module")
def kilt_src(tmp_path_factory):
    root = tmp_path_factory.mktemp("kilt")
    pages = write_kilt(root / "ks.json", 90)
    aida = root / "aida"
    aida.mkdir()
    train = [
        aida_line("1 EU", pages[0][1], str(pages[0][0]), pages[0][1]),          # by id
        aida_line("2 EU", "Renamed", str(pages[5][0]), "Old Title Of Five"),    # by id, title outdated
        aida_line("3 EU", pages[7][1], "999999", pages[7][1]),                  # id unknown, title resolves
        aida_line("4 EU", "Ghost", "888888", "No Such Page"),                   # missing
        aida_line("5 EU", pages[9][1], str(pages[9][0]), pages[9][1]),
    ]
    (aida / "aidayago2-train-kilt.jsonl").write_text("\n".join(train) + "\n")
    (aida / "aidayago2-dev-kilt.jsonl").write_text(aida_line("d1", "Lost", "777", "Lost Page") + "\n")
    (aida / "aidayago2-test_without_answers-kilt.jsonl").write_text(aida_line("t1", "x", None, None) + "\n")
    return root, pages


def test_kilt_aida_store_and_gold_resolution(tmp_path, kilt_src, minilm_dir):
    root, pages = kilt_src
    m = prepare(cfg(tmp_path, kilt_ks=str(root / "ks.json"), aida_dir=str(root / "aida"), model_dir=minilm_dir,
                    chunk_size="2K", entity_max_len=40, mention_max_len=16), **QUIET)
    out = tmp_path / "out"
    rows = all_rows(out)
    assert [(int(r["source_id"]), r["title"]) for r in rows] == pages
    assert [r["line"] for r in rows] == list(range(1, 91))
    # Token ids equal the per-record reference encoder.
    tok = load_tokenizer(minilm_dir)
    src_lines = (root / "ks.json").read_text().splitlines()
    for i in (0, 41, 89):
        obj = json.loads(src_lines[i])
        ref = encode_entity(tok, obj["wikipedia_title"], " ".join(p.strip() for p in obj["text"][1:]), 40)
        assert rows[i]["token_ids"][:len(ref)] == ref and rows[i]["length"] == len(ref)

    train = mention_rows(out, "train")
    assert [r["gold_status"] for r in train] == ["id", "id", "title", "missing", "id"]
    assert [r["gold_row"] for r in train] == [0, 5, 7, -1, 9]
    ref = encode_mention(tok, "EU rejects German call", pages[0][1], "to boycott lamb .", 16)
    assert train[0]["token_ids"][:len(ref)] == ref
    info = m["mentions"]["train"]
    assert info["gold"] == {"id": 3, "title": 1, "missing": 1, "unlabelled": 0}
    assert info["missing_gold"] == {"count": 1, "mention_ids": ["4 EU"], "listed": 1}
    assert m["mentions"]["dev"]["missing_gold"]["mention_ids"] == ["d1"]
    test = MentionTable(out, "test")
    assert test.gold_status == ["unlabelled"] and test.gold_rows.tolist() == [-1]
    assert m["entities"]["count"] == 90 and m["skipped"]["count"] == 0
    assert m["tokenizer_sha256"] == m["tokenizer"]["sha256"] and m["source"]["files"][0]["size"] > 0
    text = summarize(out)
    assert "entities: 90" in text and "mentions train: 5; gold by id 3, by title 1, missing 1" in text
    assert "4 EU" in text


def test_duplicate_mention_ids_are_bad_records(tmp_path, kilt_src, minilm_dir):
    """KILT keys guesses by id (stripped): a repeated id in a split is refused at prepare, not after retrieval."""
    shared, pages = kilt_src
    root = tmp_path / "src"  # the fixture's files are shared by the module's tests
    shutil.copytree(shared, root)
    dev = root / "aida" / "aidayago2-dev-kilt.jsonl"
    dev.write_text(aida_line("d1", "Lost", "777", "Lost Page") + "\n"
                   + aida_line("d2", pages[1][1], str(pages[1][0]), pages[1][1]) + "\n"
                   + aida_line(" d1", pages[2][1], str(pages[2][0]), pages[2][1]) + "\n")
    common = dict(kilt_ks=str(root / "ks.json"), aida_dir=str(root / "aida"), model_dir=minilm_dir, chunk_size="2K")
    with pytest.raises(BadRecord, match=r"aidayago2-dev-kilt.jsonl:3: duplicate mention id ' d1' \(first at line 1\)"):
        prepare(cfg(tmp_path, **common), **QUIET)
    assert not (tmp_path / "out" / "manifest.json").exists()
    m = prepare(cfg(tmp_path, on_bad_record="skip", **common), **QUIET)
    assert [r["mention_id"] for r in mention_rows(tmp_path / "out", "dev")] == ["d1", "d2"]
    assert m["mentions"]["dev"]["count"] == 2 and m["mentions"]["train"]["count"] == 5
    assert [(r["path"], r["line"]) for r in m["skipped"]["records"]] == [(str(dev), 3)]


def _compare_stores(a: Path, b: Path) -> None:
    assert all_rows(a) == all_rows(b)
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma["entities"]["token_stats"] == mb["entities"]["token_stats"]
    assert set(ma["mentions"]) == set(mb["mentions"])
    for split in ma["mentions"]:
        assert mention_rows(a, split) == mention_rows(b, split)
    assert read_arrow(a / "entities" / "source_index.arrow").equals(read_arrow(b / "entities" / "source_index.arrow"))


def test_result_independent_of_chunking_and_workers(tmp_path, kilt_src, minilm_dir):
    root, _ = kilt_src
    common = dict(kilt_ks=str(root / "ks.json"), aida_dir=str(root / "aida"), model_dir=minilm_dir,
                  entity_max_len=32, rows_per_part=16)
    m1 = prepare(cfg(tmp_path, name="one", chunk_size="1G", **common), **QUIET)
    m2 = prepare(cfg(tmp_path, name="many", chunk_size="1500", workers=2, **common), **QUIET)
    assert m1["ingest"]["chunks"] == 4 and m2["ingest"]["chunks"] > 10
    _compare_stores(tmp_path / "one", tmp_path / "many")


def test_rerun_reuses_chunks_and_detects_changes(tmp_path, kilt_src, minilm_dir):
    root, _ = kilt_src
    c = cfg(tmp_path, kilt_ks=str(root / "ks.json"), model_dir=minilm_dir, chunk_size="4K", keep_chunks=True)
    first = prepare(c, **QUIET)
    assert prepare(c, **QUIET)["created_utc"] == first["created_utc"]  # up to date: nothing redone
    (tmp_path / "out" / "manifest.json").unlink()  # as if killed during assembly
    again = prepare(c, **QUIET)
    assert again["ingest"]["reused_chunks"] == again["ingest"]["chunks"] == first["ingest"]["chunks"]
    changed = cfg(tmp_path, kilt_ks=str(root / "ks.json"), model_dir=minilm_dir, chunk_size="4K", entity_max_len=20)
    with pytest.raises(PrepareError, match="entity_max_len.*--overwrite"):
        prepare(changed, **QUIET)
    changed.overwrite = True
    m = prepare(changed, **QUIET)
    assert m["ingest"]["reused_chunks"] == 0 and EntityStore(tmp_path / "out").max_len == 20
    assert not (tmp_path / "out" / "chunks").exists()


# --------------------------------------------------------------------------- bad records


def _bad_kilt(tmp_path: Path) -> Path:
    replace = {
        37: '{"wikipedia_id": "137", "wikipedia_title": "Broken"',               # truncated JSON
        58: kilt_line(158, "No id", "x").replace('"wikipedia_id": "158"', '"wikipedia_id": 158'),
        71: "",                                                                  # blank: not an error
    }
    write_kilt(tmp_path / "ks.json", 80, seed=3, replace=replace)
    with open(tmp_path / "ks.json", "ab") as f:
        f.write(b'{"wikipedia_id": "\xff\xfe"}\n')  # line 81: not UTF-8
    return tmp_path / "ks.json"


def test_error_policy_stops_at_first_bad_line_with_global_line(tmp_path, minilm_dir):
    ks = _bad_kilt(tmp_path)
    with pytest.raises(BadRecord) as e:
        prepare(cfg(tmp_path, kilt_ks=str(ks), model_dir=minilm_dir, chunk_size="3K"), **QUIET)
    assert (e.value.path, e.value.line) == (str(ks), 37) and "not JSON" in e.value.reason
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_skip_policy_counts_and_records_bad_lines(tmp_path, minilm_dir):
    ks = _bad_kilt(tmp_path)
    m = prepare(cfg(tmp_path, kilt_ks=str(ks), model_dir=minilm_dir, chunk_size="3K", on_bad_record="skip"), **QUIET)
    skipped = m["skipped"]
    assert skipped["count"] == 3
    assert [(s["path"], s["line"]) for s in skipped["records"]] == [(str(ks), 37), (str(ks), 58), (str(ks), 81)]
    assert "wikipedia_id" in skipped["records"][1]["reason"] and "UTF-8" in skipped["records"][2]["reason"]
    rows = all_rows(tmp_path / "out")
    assert len(rows) == 81 - 3 - 1  # 81 lines: 3 bad, 1 blank
    assert 37 not in [r["line"] for r in rows] and rows[-1]["line"] == 80
    assert "skipped records: 3" in summarize(tmp_path / "out") and f"{ks}:58:" in summarize(tmp_path / "out")


def test_duplicate_source_ids_are_bad_records(tmp_path, minilm_dir):
    ks = tmp_path / "ks.json"
    write_kilt(ks, 30, replace={25: kilt_line(103, "Copy of three", "dup")})
    with pytest.raises(BadRecord, match=r"ks.json:25: duplicate source id '103' \(first at line 4\)"):
        prepare(cfg(tmp_path, kilt_ks=str(ks), model_dir=minilm_dir, chunk_size="1K"), **QUIET)
    m = prepare(cfg(tmp_path, kilt_ks=str(ks), model_dir=minilm_dir, chunk_size="1K", on_bad_record="skip"),
                **QUIET)
    assert m["entities"]["count"] == 29 and m["skipped"]["records"][0]["line"] == 25
    store = EntityStore(tmp_path / "out")
    assert store.rows_for_source_ids(["103", "104", "129"]).tolist() == [3, 4, 28]


# --------------------------------------------------------------------------- Zeshel and BLINK


def _zeshel(root: Path) -> dict[str, list[tuple[str, str, str]]]:
    from kb.zeshel import ZESHEL_WORLDS

    docs: dict[str, list[tuple[str, str, str]]] = {}
    rng = random.Random(5)
    for split, worlds in ZESHEL_WORLDS.items():
        for w in worlds:
            docs[w] = []
            for j in range(3):
                title = f"{w.split('_')[0].title()} {j}"
                text = f"{title} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
                docs[w].append((f"{abs(hash((w, j))) % 16**16:016X}", title, text))
    (root / "documents").mkdir()
    for w, items in docs.items():
        (root / "documents" / f"{w}.json").write_text(
            "".join(json.dumps({"document_id": d, "title": t, "text": x}) + "\n" for d, t, x in items))
    (root / "mentions").mkdir()
    for split, worlds in ZESHEL_WORLDS.items():
        lines = []
        for k, w in enumerate(worlds):
            ctx_id, _, ctx = docs[w][0]
            label = docs[w][1][0] if k else "FFFFFFFFFFFFFFFF"  # first mention of each split: gold missing
            tokens = ctx.split()
            lines.append(json.dumps({"mention_id": f"{split}-{k}", "context_document_id": ctx_id, "corpus": w,
                                     "start_index": 1, "end_index": 2, "text": " ".join(tokens[1:3]),
                                     "label_document_id": label, "category": "LOW_OVERLAP"}))
        (root / "mentions" / f"{split}.json").write_text("\n".join(lines) + "\n")
    return docs


def test_zeshel_worlds_mentions_and_strip_title(tmp_path, minilm_dir):
    from kb.zeshel import ZESHEL_WORLDS

    docs = _zeshel(tmp_path)
    m = prepare(cfg(tmp_path, zeshel_root=str(tmp_path), model_dir=minilm_dir, zeshel_strip_title=True,
                    mention_max_len=24, entity_max_len=32), **QUIET)
    store = EntityStore(tmp_path / "out")
    assert store.num_entities == 48 and set(store.world_ranges()) == set(docs)
    tok = load_tokenizer(minilm_dir)
    for w, (a, b) in store.world_ranges().items():
        assert b - a == 3 and store.worlds(list(range(a, b))) == [w] * 3
        assert store.source_ids([a]) == [docs[w][0][0]]
        ref = encode_entity(tok, docs[w][0][1], docs[w][0][2], 32, strip_title=True)
        assert store.token_ids([a])[0, :len(ref)].tolist() == ref
    for split, worlds in ZESHEL_WORLDS.items():
        table = MentionTable(tmp_path / "out", split)
        assert table.worlds == worlds and table.categories == ["LOW_OVERLAP"] * len(worlds)
        assert table.gold_status == ["missing"] + ["id"] * (len(worlds) - 1)
        want = store.rows_for_source_ids([docs[w][1][0] for w in worlds[1:]])
        assert table.gold_rows.tolist() == [-1] + want.tolist()
        assert m["mentions"][split]["missing_gold"]["mention_ids"] == [f"{split}-0"]
        assert m["mentions"][split]["gold_world_mismatch"] == 0
    assert "worlds: 16" in summarize(tmp_path / "out")


def test_blink_entities(tmp_path, minilm_dir):
    lines = [json.dumps({"text": f" Text of page {i}. ", "idx": f"https://en.wikipedia.org/wiki?curid={40 + i}",
                         "title": f"Page {i}", "entity": f"Page {i}"}) for i in range(6)]
    (tmp_path / "entity.jsonl").write_text("\n".join(lines) + "\n")
    prepare(cfg(tmp_path, blink_entities=str(tmp_path / "entity.jsonl"), model_dir=minilm_dir), **QUIET)
    store = EntityStore(tmp_path / "out")
    assert store.source_ids(np.arange(6)) == [str(40 + i) for i in range(6)]
    assert store.rows_for_source_ids(["45", "46"]).tolist() == [5, -1]


def test_config_validation(tmp_path):
    from dist_nce.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="exactly one of"):
        from_dict(PrepareConfig, {"out": "x", "kilt_ks": "a", "zeshel_root": "b"})
    with pytest.raises(ConfigError, match="zeshel-strip-title"):
        from_dict(PrepareConfig, {"out": "x", "kilt_ks": "a", "zeshel_strip_title": True})
    with pytest.raises(FileNotFoundError, match="KILT knowledge source not found"):
        prepare(cfg(tmp_path, kilt_ks=str(tmp_path / "nope.json")), **QUIET)
