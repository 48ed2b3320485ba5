"""Synthetic KILT / AIDA / BLINK / Zeshel generators: real formats, determinism,
realism knobs, the structure that makes context (and so hard negatives) matter, and
constant-memory streaming."""
from __future__ import annotations

import collections
import gc
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_nce.core.artifacts import file_sha256, read_manifest
from dist_nce.core.records import BadRecordLog
from kb.blink import iter_blink_entities
from kb.kilt import iter_aida, iter_kilt_entities
import kb.synthetic.kilt as synthetic_kilt
from kb.synthetic import SPLITS, KiltUniverse, Knobs, write_kilt, write_zeshel, zeshel_category
from kb.synthetic.__main__ import main as cli_main
from kb.synthetic.lexicon import KILT_DOMAINS, WORD2, WORD3, accent, one_word_name, two_word_name
from kb.synthetic.sink import JsonlSink
from kb.synthetic.universe import FUNCTION_WORDS, AffinePermutation
from kb.zeshel import ZESHEL_WORLDS, iter_zeshel_documents, iter_zeshel_mentions

ZWORLDS = ["starwars", "military", "muppets", "lego"]  # two train, one val, one test world


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _data_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def kilt_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kilt")
    write_kilt(out, 1500, 300, 600, 100, seed=3, blink=True, title_drift=0.1, missing_gold=0.05)
    return out


@pytest.fixture(scope="module")
def zeshel_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zeshel")
    write_zeshel(out, ZWORLDS, entities_per_world=300, mentions_per_world=250, seed=5)
    return out


# ---- KILT knowledge source ------------------------------------------------------------
def test_kilt_knowledge_source_fields_and_types(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    assert len(pages) == 1500
    by_id = {p["wikipedia_id"]: p for p in pages}
    assert len(by_id) == 1500 and len({p["wikipedia_title"] for p in pages}) == 1500
    with_wikidata = 0
    anchors = 0
    for p in pages:
        assert set(p) >= {"_id", "wikipedia_id", "wikipedia_title", "text", "anchors", "categories", "history"}
        assert isinstance(p["_id"], str) and re.fullmatch(r"[0-9]+", p["wikipedia_id"])
        assert isinstance(p["text"], list) and len(p["text"]) >= 3
        assert all(isinstance(t, str) and t.endswith("\n") for t in p["text"])
        assert p["text"][0] == p["wikipedia_title"] + "\n"
        assert isinstance(p["categories"], str)
        h = p["history"]
        assert set(h) == {"revid", "timestamp", "parentid", "pre_dump", "pageid", "url"}
        assert h["pageid"] == int(p["wikipedia_id"]) and isinstance(h["pre_dump"], bool)
        for a in p["anchors"]:
            anchors += 1
            assert set(a) == {"paragraph_id", "start", "end", "text", "href", "wikipedia_title", "wikipedia_id"}
            assert p["text"][a["paragraph_id"]][a["start"]:a["end"]] == a["text"]
            assert by_id[a["wikipedia_id"]]["wikipedia_title"] == a["wikipedia_title"]
            assert a["wikipedia_title"].startswith(a["text"])
        if "wikidata_info" in p:
            with_wikidata += 1
            w = p["wikidata_info"]
            assert re.fullmatch(r"Q[0-9]+", w["wikidata_id"]) and isinstance(w["aliases"], list)
            assert w["wikipedia_title"] == p["wikipedia_title"]
    assert 0.8 * len(pages) < with_wikidata < len(pages)  # most lines, not all
    assert anchors > 500
    assert any(t.startswith("Section::::") for p in pages for t in p["text"])
    assert any(not p["categories"] for p in pages) and any("," in p["categories"] for p in pages)
    ids = [int(p["wikipedia_id"]) for p in pages]
    assert ids == sorted(ids)


def test_kilt_output_parses_with_the_readers(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    records = list(iter_kilt_entities(kilt_dir / "kilt_knowledgesource.json"))
    assert [r.source_id for r in records] == [p["wikipedia_id"] for p in pages]
    blink = list(iter_blink_entities(kilt_dir / "entity.jsonl"))
    assert [(b.source_id, b.title) for b in blink] == [(r.source_id, r.title) for r in records]
    for split, n in (("train", 300), ("dev", 600)):
        ments = list(iter_aida(kilt_dir / f"aidayago2-{split}-kilt.jsonl"))
        assert len(ments) == n and all(m.gold_source_id for m in ments)
    test = list(iter_aida(kilt_dir / "aidayago2-test_without_answers-kilt.jsonl"))
    assert len(test) == 100 and all(m.gold_source_id is None for m in test)


def test_blink_entities_match_the_kb(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    blink = _jsonl(kilt_dir / "entity.jsonl")
    for p, b in zip(pages, blink, strict=True):
        assert set(b) == {"text", "idx", "title", "entity"}
        assert b["idx"] == f"https://en.wikipedia.org/wiki?curid={p['wikipedia_id']}"
        assert b["title"] == b["entity"] == p["wikipedia_title"]
        assert b["text"].startswith(" ") and p["text"][1].strip() in b["text"]


# ---- AIDA ----------------------------------------------------------------------------
def test_aida_fields_and_marked_input(kilt_dir):
    for split, labelled in (("train", True), ("dev", True), ("test_without_answers", False)):
        rows = _jsonl(kilt_dir / f"aidayago2-{split}-kilt.jsonl")
        for r in rows:
            assert ("output" in r) is labelled
            assert isinstance(r["id"], str)
            m = r["meta"]
            assert set(m) == {"left_context", "mention", "right_context"}
            expect = " ".join(x for x in (m["left_context"], "[START_ENT]", m["mention"], "[END_ENT]",
                                          m["right_context"]) if x)
            assert r["input"] == expect and r["input"] == " ".join(r["input"].split())
            if labelled:
                (out,) = r["output"]
                (prov,) = out["provenance"]
                assert set(out) == {"answer", "provenance"} and set(prov) == {"wikipedia_id", "title"}
                assert re.fullmatch(r"[0-9]+", prov["wikipedia_id"]) and prov["title"] == out["answer"]
    rows = _jsonl(kilt_dir / "aidayago2-dev-kilt.jsonl")
    assert len({r["id"] for r in rows}) == len(rows)
    # Mentions at the very start and the very end of a context both occur.
    assert any(r["input"].startswith("[START_ENT]") for r in rows)
    assert any(r["input"].endswith("[END_ENT]") for r in rows)
    # Contexts are long enough to exercise truncation (20..60 words a side by default).
    lengths = [len(r["meta"]["left_context"].split()) for r in rows if r["meta"]["left_context"]]
    assert min(lengths) >= 20 and sum(lengths) / len(lengths) > 35


def test_title_drift_and_missing_gold_at_requested_rates(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    title_of = {p["wikipedia_id"]: p["wikipedia_title"] for p in pages}
    titles = set(title_of.values())
    rows = _jsonl(kilt_dir / "aidayago2-dev-kilt.jsonl") + _jsonl(kilt_dir / "aidayago2-train-kilt.jsonl")
    missing = drifted = 0
    for r in rows:
        out = r["output"][0]
        wid = out["provenance"][0]["wikipedia_id"]
        if wid not in title_of:
            missing += 1
            assert out["answer"] not in titles  # a missing gold is not a renamed KB page
        elif out["answer"] != title_of[wid]:
            drifted += 1
            assert out["answer"] not in titles  # resolvable by wikipedia_id only, never by title
    n = len(rows)
    assert 0.02 < missing / n < 0.09  # requested 0.05
    assert 0.06 < drifted / (n - missing) < 0.15  # requested 0.1
    manifest = read_manifest(kilt_dir, "synthetic_kilt", 1)
    counts = manifest["counts"]
    assert counts["train"]["missing_gold"] + counts["dev"]["missing_gold"] == missing
    assert counts["train"]["title_drift"] + counts["dev"]["title_drift"] == drifted


def test_defaults_have_no_missing_gold(tmp_path):
    write_kilt(tmp_path, 300, 200, 0, 0, seed=1)
    ids = {p["wikipedia_id"] for p in _jsonl(tmp_path / "kilt_knowledgesource.json")}
    rows = _jsonl(tmp_path / "aidayago2-train-kilt.jsonl")
    assert all(r["output"][0]["provenance"][0]["wikipedia_id"] in ids for r in rows)
    # A split asked for no mentions gets no file (an empty one is an error to kb.prepare).
    assert not (tmp_path / "aidayago2-dev-kilt.jsonl").exists()
    assert not (tmp_path / "entity.jsonl").exists()


# ---- structure: shared names, and context beats the name ---------------------------
def _bare(title: str) -> str:
    return title.split(" (")[0]


def _content(text: str) -> set[str]:
    return {w.strip(".,").lower() for w in text.split()} - set(FUNCTION_WORDS) - {""}


def _baselines(entities: list[tuple[str, str, str]], mentions: list[tuple[str, str, str, str]],
               window: int = 30, seed: int = 0):
    """Accuracy of two string baselines over (id, title, description) entities and
    (left, mention, right, gold id) mentions: ``name``: the entity titled exactly the
    mention, else a random one whose title contains it (else any); ``overlap``: among
    those, the one whose description shares the most content words with the mention
    and ``window`` words on each side of it (what a 128-token encoder would see)."""
    rng = random.Random(seed)
    words = {i: _content(d) for i, _, d in entities}
    name_ok = overlap_ok = 0
    for left, mention, right, gold in mentions:
        cands = [e for e in entities if mention.lower() in e[1].lower()] or entities
        exact = [e for e in cands if e[1] == mention]
        name_ok += (exact[0] if exact else rng.choice(cands))[0] == gold
        ctx = _content(" ".join([*left.split()[-window:], mention, *right.split()[:window]]))
        overlap_ok += max(cands, key=lambda e: len(ctx & words[e[0]]))[0] == gold
    return name_ok / len(mentions), overlap_ok / len(mentions)


def test_shared_surface_names(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    groups = collections.Counter(_bare(p["wikipedia_title"]) for p in pages)
    sizes = collections.Counter(groups.values())
    assert sizes[1] > 0 and sizes[2] > 0 and sizes[3] > 0 and max(sizes) <= 4
    shared = {name for name, c in groups.items() if c > 1}
    # Wikipedia-style qualifiers, including the "born YEAR" form for same-domain siblings.
    assert any(re.search(r" \(\w[\w ]*, born \d{4}\)$", p["wikipedia_title"]) for p in pages)
    rows = _jsonl(kilt_dir / "aidayago2-dev-kilt.jsonl")
    on_shared = sum(r["meta"]["mention"] in shared for r in rows)
    assert on_shared / len(rows) > 0.5  # most mentions need disambiguation


def test_context_beats_name_matching_kilt(kilt_dir):
    pages = _jsonl(kilt_dir / "kilt_knowledgesource.json")
    entities = [(p["wikipedia_id"], p["wikipedia_title"], " ".join(p["text"][1:])) for p in pages]
    ids = {e[0] for e in entities}
    mentions = []
    for r in _jsonl(kilt_dir / "aidayago2-dev-kilt.jsonl")[:300]:
        gold = r["output"][0]["provenance"][0]["wikipedia_id"]
        if gold in ids:
            m = r["meta"]
            mentions.append((m["left_context"], m["mention"], m["right_context"], gold))
    name_acc, overlap_acc = _baselines(entities, mentions)
    assert name_acc < 0.65
    assert overlap_acc > 0.85 and overlap_acc > name_acc + 0.25


def test_context_beats_name_matching_zeshel(zeshel_dir):
    docs = {r.source_id: r for r in iter_zeshel_documents(zeshel_dir, ["lego"])}
    entities = [(i, r.title, r.description[len(r.title):]) for i, r in docs.items()]
    mentions = [(m.left, m.mention, m.right, m.gold_source_id)
                for m in iter_zeshel_mentions(zeshel_dir, "test")]
    name_acc, overlap_acc = _baselines(entities, mentions)
    # Zeshel mentions are mostly aliases or partial names: the name alone is weak.
    assert name_acc < 0.5
    assert overlap_acc > name_acc + 0.2


# ---- determinism, manifest, CLI ------------------------------------------------------
def test_kilt_is_deterministic_by_seed(tmp_path):
    a, b, c = (tmp_path / x for x in "abc")
    for out, seed in ((a, 7), (b, 7), (c, 8)):
        write_kilt(out, 400, 50, 20, 10, seed=seed, blink=True, missing_gold=0.1)
    fa, fb, fc = _data_files(a), _data_files(b), _data_files(c)
    assert len(fa) == 5 and fa == fb
    assert all(fa[k] != fc[k] for k in fa)


def test_parallel_workers_write_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic_kilt, "_CHUNK", 100)  # several chunks per worker
    write_kilt(tmp_path / "one", 450, 5, 5, 5, seed=2, blink=True)
    write_kilt(tmp_path / "two", 450, 5, 5, 5, seed=2, blink=True, workers=2)
    assert _data_files(tmp_path / "one") == _data_files(tmp_path / "two")


def test_zeshel_is_deterministic_by_seed(tmp_path):
    for out, seed in ((tmp_path / "a", 1), (tmp_path / "b", 1), (tmp_path / "c", 2)):
        write_zeshel(out, ["starwars", "lego"], entities_per_world=60, mentions_per_world=40, seed=seed)
    fa, fb, fc = (_data_files(tmp_path / x) for x in "abc")
    # starwars (train) and lego (test): no val world, so no (empty) val.json
    assert sorted(fa) == ["documents/lego.json", "documents/starwars.json", "mentions/heldout_train_seen.json",
                          "mentions/heldout_train_unseen.json", "mentions/test.json", "mentions/train.json"]
    assert fa == fb
    assert fa["documents/lego.json"] != fc["documents/lego.json"]


def test_manifest_describes_the_files(kilt_dir):
    manifest = read_manifest(kilt_dir, "synthetic_kilt", 1)
    assert manifest["seed"] == 3 and manifest["num_entities"] == 1500 and manifest["knobs"]["signature_words"] == 4
    assert set(manifest["files"]) == {"kilt_knowledgesource.json", "entity.jsonl", "aidayago2-train-kilt.jsonl",
                                      "aidayago2-dev-kilt.jsonl", "aidayago2-test_without_answers-kilt.jsonl"}
    for name, info in manifest["files"].items():
        path = kilt_dir / name
        assert info["sha256"] == file_sha256(path)
        assert info["lines"] == len(path.read_bytes().splitlines())
    assert not list(kilt_dir.glob(".*tmp"))  # no temporaries left behind


def test_cli_writes_both_formats(tmp_path):
    assert cli_main(["kilt", "--out", str(tmp_path / "k"), "--entities", "200", "--train", "20", "--dev", "5",
                     "--test", "5", "--seed", "1", "--blink", "--context-words", "5", "10"]) == 0
    assert len(_jsonl(tmp_path / "k" / "entity.jsonl")) == 200
    row = _jsonl(tmp_path / "k" / "aidayago2-train-kilt.jsonl")[0]
    assert len(row["meta"]["right_context"].split()) <= 10 + 12  # + kept signature words, name, punctuation
    read_manifest(tmp_path / "k", "synthetic_kilt", 1, expect={"seed": 1})
    assert cli_main(["zeshel", "--out", str(tmp_path / "z"), "--entities-per-world", "30",
                     "--mentions-per-world", "10", "--worlds", "yugioh", "--seed", "2"]) == 0
    assert len(_jsonl(tmp_path / "z" / "mentions" / "test.json")) == 10


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="title_drift"):
        write_kilt(tmp_path, 10, 1, 1, 1, title_drift=1.5)
    with pytest.raises(ValueError, match="worlds"):
        write_zeshel(tmp_path, ["narnia"])
    with pytest.raises(ValueError, match="context_words"):
        write_kilt(tmp_path, 10, 1, 1, 1, knobs=Knobs(context_words=(5, 2)))
    with pytest.raises(ValueError, match="mentions_per_world"):
        write_zeshel(tmp_path, ["lego", "yugioh"], mentions_per_world={"lego": 3})


# ---- Zeshel ----------------------------------------------------------------------------
def test_zeshel_layout_fields_and_inclusive_indices(zeshel_dir):
    docs = {}
    for w in ZWORLDS:
        rows = _jsonl(zeshel_dir / "documents" / f"{w}.json")
        assert len(rows) == 300
        for r in rows:
            assert set(r) == {"document_id", "title", "text"}
            assert re.fullmatch(r"[0-9A-F]{16}", r["document_id"])
            assert r["text"].startswith(r["title"] + " ")
            docs[r["document_id"]] = (w, r)
    assert len(docs) == 300 * len(ZWORLDS)  # ids unique across worlds
    per_world = collections.Counter()
    ids = set()
    for split in SPLITS:
        for m in _jsonl(zeshel_dir / "mentions" / f"{split}.json"):
            assert list(m) == ["mention_id", "context_document_id", "corpus", "start_index", "end_index", "text",
                               "label_document_id", "category"]
            assert re.fullmatch(r"[0-9A-F]{16}", m["mention_id"]) and m["mention_id"] not in docs
            ids.add(m["mention_id"])
            world, ctx = docs[m["context_document_id"]]
            gold_world, gold = docs[m["label_document_id"]]
            assert world == gold_world == m["corpus"]
            assert m["context_document_id"] != m["label_document_id"]
            tokens = ctx["text"].split()
            assert 0 <= m["start_index"] <= m["end_index"] < len(tokens)
            assert " ".join(tokens[m["start_index"]:m["end_index"] + 1]) == m["text"]  # inclusive end
            assert m["category"] == zeshel_category(m["text"], gold["title"])
            per_world[m["corpus"]] += 1
    assert per_world == {w: 250 for w in ZWORLDS} and len(ids) == 250 * len(ZWORLDS)


def test_zeshel_worlds_are_disjoint_and_splits_follow_worlds(zeshel_dir):
    world_split = {w: s for s, ws in ZESHEL_WORLDS.items() for w in ws}
    golds = {}
    for split in SPLITS:
        rows = _jsonl(zeshel_dir / "mentions" / f"{split}.json")
        assert rows, split
        want = "train" if split.startswith("heldout") else split
        assert {world_split[r["corpus"]] for r in rows} == {want}
        golds[split] = {r["label_document_id"] for r in rows}
    assert not golds["heldout_train_unseen"] & golds["train"]
    assert not golds["heldout_train_unseen"] & golds["heldout_train_seen"]
    titles = {w: {r["title"] for r in _jsonl(zeshel_dir / "documents" / f"{w}.json")} for w in ZWORLDS}
    assert not titles["starwars"] & titles["lego"]
    n_train_world = 2 * 250
    assert 0.03 < len(_jsonl(zeshel_dir / "mentions" / "heldout_train_seen.json")) / n_train_world < 0.15
    categories = {r["category"] for s in SPLITS for r in _jsonl(zeshel_dir / "mentions" / f"{s}.json")}
    assert categories == {"HIGH_OVERLAP", "MULTIPLE_CATEGORIES", "AMBIGUOUS_SUBSTRING", "LOW_OVERLAP"}


def test_zeshel_output_parses_with_the_readers(zeshel_dir):
    docs = list(iter_zeshel_documents(zeshel_dir))
    assert len(docs) == 300 * len(ZWORLDS)
    bad = BadRecordLog("error")
    n = sum(1 for split in SPLITS for _ in iter_zeshel_mentions(zeshel_dir, split, bad))
    assert n == 250 * len(ZWORLDS)
    manifest = read_manifest(zeshel_dir, "synthetic_zeshel", 1)
    assert sum(manifest["counts"]["splits"].values()) == n


def test_zeshel_category_rules():
    assert zeshel_category("Mabror Shiodond", "Mabror Shiodond") == "HIGH_OVERLAP"
    assert zeshel_category("Mabror Shiodond", "Mabror Shiodond (starship)") == "MULTIPLE_CATEGORIES"
    assert zeshel_category("Shiodond", "Mabror Shiodond (starship)") == "AMBIGUOUS_SUBSTRING"
    assert zeshel_category("Pictures", "Mabror Shiodond") == "LOW_OVERLAP"


# ---- building blocks -----------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 97, 1000])
def test_affine_permutation_is_a_bijection_with_inverse(n):
    perm = AffinePermutation(0xDEADBEEF12345, n)
    image = [perm(i) for i in range(n)]
    assert sorted(image) == list(range(n))
    assert [perm.inverse(p) for p in image] == list(range(n))


def test_names_are_injective():
    for f, span in ((two_word_name, WORD2 * WORD2), (one_word_name, WORD3)):
        xs = list(range(20000)) + [span - 1 - i for i in range(20000)] + [(7919 * i) % span for i in range(20000)]
        names = {x: f(x) for x in xs}
        assert len(set(names.values())) == len(names)
    # An accent is invertible (generated names have no accented letters), so it keeps names unique.
    for nm in (two_word_name(x) for x in range(0, 10**9, 99991)):
        for which in (0, 1):
            assert accent(nm, which).replace("ö", "o").replace("é", "e") == nm


def test_outdated_qualifiers_never_name_a_current_page():
    current = {d.qualifier for d in KILT_DOMAINS}
    old = {d.old_qualifier for d in KILT_DOMAINS}
    assert len(current) == len(KILT_DOMAINS) == len(old) and not current & old


def test_same_name_siblings_get_unique_titles():
    ku = KiltUniverse(0, 5000, Knobs(sibling_same_domain=0.8))  # force many same-domain siblings
    titles = [ku.title(i) for i in range(5000)]
    assert len(set(titles)) == 5000


# ---- streaming -----------------------------------------------------------------------
def _peak_blocks(tmp_path: Path, n: int, monkeypatch) -> int:
    """Most Python memory blocks alive at any chunk write while writing ``n`` entities."""
    peak = 0
    write = JsonlSink.write_encoded

    def spy(self, data: bytes, lines: int) -> None:
        nonlocal peak
        peak = max(peak, sys.getallocatedblocks())
        write(self, data, lines)

    monkeypatch.setattr(JsonlSink, "write_encoded", spy)
    monkeypatch.setattr(synthetic_kilt, "_CHUNK", 256)
    gc.collect()
    write_kilt(tmp_path / f"n{n}", n, 0, 0, 0, seed=0, knobs=Knobs(num_topics=64), progress=False)
    return peak


def test_streaming_memory_does_not_grow_with_kb_size(tmp_path, monkeypatch):
    _peak_blocks(tmp_path, 512, monkeypatch)  # warm imports and caches
    small, large = _peak_blocks(tmp_path, 1024, monkeypatch), _peak_blocks(tmp_path, 10240, monkeypatch)
    # Anything kept per entity would add at least one block for each of the 9,216 more.
    assert large - small < 1500, (small, large)


@pytest.mark.slow
def test_streaming_rss_60k_entities(tmp_path):
    def peak_rss_mib(n: int) -> float:
        proc = subprocess.run(
            [sys.executable, "-m", "kb.synthetic", "kilt", "--out", str(tmp_path / str(n)), "--entities", str(n),
             "--train", "0", "--dev", "0", "--test", "0"],
            capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
        return json.loads(proc.stderr[proc.stderr.index("{"):])["peak_rss_mib"]

    small, large = peak_rss_mib(2000), peak_rss_mib(60_000)
    # 60k pages are ~75 MB of JSON; streaming keeps the process near its start size.
    assert large - small < 30, (small, large)
