"""KILT guess files and KILT's EL scores: hand-computed files, a minimal reference, the CLI."""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import numpy as np
import pytest

from dist_nce.eval import kilt as K


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _gold(id_, input_, *outputs):
    """outputs: (answer, [(wikipedia_id, title), ...]) pairs."""
    return {
        "id": id_,
        "input": input_,
        "output": [
            {"answer": a, "provenance": [{"wikipedia_id": w, "title": t} for w, t in prov]} for a, prov in outputs
        ],
        "meta": {},
    }


# Seven AIDA-like mentions, each probing one rule. Per-item values are worked out by hand:
#      acc em  Rprec  rank (T=set completed, F=miss)  p@1 p@5  r@5  entity_in_input
# A    1   1   1      [T, F]                          1   1/5  1    1 ("paris" in input)
# B    0   1   1      [T]            title drift      1   1/5  1    0
# C    1   1   0      [F, T]         answer ok, Rprec<1  0 1/5  1    0
# D    0   1   1/2    [F, T]         two-page set     0   1/5  1    0
# E    1   1   1      [T, T]         two gold outputs 1   2/5  1    1 ("georgia")
# F    0   0   0      []             empty guess      0   0    0    0
# G    0   0   1/2    [F, T]         duplicated guess page  0  1/5  1  1 ("foo")
GOLD = [
    _gold("A", "we flew to [START_ENT] Paris [END_ENT] today", ("Paris", [("100", "Paris")])),
    _gold(2, "[START_ENT] Washington [END_ENT] said", ("Washington, D.C.", [("200", "Washington, D.C.")])),
    _gold("C 3", "in [START_ENT] New York [END_ENT] ,", ("New York City", [("300", "New York City")])),
    _gold(
        "D",
        "[START_ENT] Germany [END_ENT] won",
        ("Germany", [("400", "Germany national football team"), ("401", "West Germany national football team")]),
    ),
    _gold(
        "E",
        "[START_ENT] Georgia [END_ENT] votes",
        ("Georgia (country)", [("500", "Georgia (country)")]),
        ("Georgia", [("501", "Georgia")]),
    ),
    _gold("F", "in [START_ENT] Edo [END_ENT]", ("Tokyo", [("600", "Tokyo")])),
    _gold("G", "[START_ENT] Foo [END_ENT] played", ("Foo", [("701", "Foo Fighters"), ("702", "Foo")])),
]
GUESS = [  # in another order than gold: KILT (and we) align on ids
    K.guess_record("E", ["501", "500"], "Georgia"),
    K.guess_record("A", np.array([100, 101, -1]).tolist(), "Paris"),
    K.guess_record(2, [200], "Washington D.C."),  # KB title differs from the AIDA title
    K.guess_record("C 3", ["301", "300"], "New York City"),
    K.guess_record("D", ["401", "999", "400"], "germany"),
    K.guess_record("F", [], ""),
    # written by hand: our writer refuses duplicate pages, KILT deduplicates them (-> 703, 701, 702)
    {"id": "G", "output": [{"answer": "Bar", "provenance": [{"wikipedia_id": w} for w in ["703", "703", "701", "702"]]}]},
]


@pytest.fixture
def files(tmp_path):
    return _write_jsonl(tmp_path / "gold.jsonl", GOLD), _write_jsonl(tmp_path / "guess.jsonl", GUESS)


def test_hand_made_files(files):
    s = K.kilt_scores(*files)
    ap = pytest.approx
    assert set(s) == {"downstream", "kilt", "retrieval"}
    assert s["downstream"]["accuracy"] == ap(3 / 7)  # A, C, E
    assert s["downstream"]["em"] == ap(5 / 7)  # + B (drift in punctuation only), D (case)
    assert s["downstream"]["f1"] == ap(5 / 7)
    assert s["kilt"]["KILT-accuracy"] == ap(2 / 7)  # A, E: C has the answer but Rprec 0
    assert s["kilt"]["KILT-em"] == ap(3 / 7)  # A, B, E
    r = s["retrieval"]
    assert r["Rprec"] == ap((1 + 1 + 0 + 0.5 + 1 + 0 + 0.5) / 7)
    assert r["precision@1"] == ap(3 / 7)
    assert r["precision@5"] == ap((0.2 * 5 + 0.4) / 7)
    assert r["recall@5"] == ap(6 / 7) and r["recall@100"] == ap(6 / 7)
    assert r["success_rate@5"] == ap(6 / 7)
    assert r["entity_in_input"] == ap(3 / 7)
    assert "recall@1" not in r and "success_rate@1" not in r  # KILT defines them for k > 1 only
    assert r["answer_in_context@5"] == 0  # our guesses carry no provenance text


def test_downstream_and_kilt_blocks_have_kilts_keys(files):
    s = K.kilt_scores(*files)
    assert list(s["downstream"]) == ["accuracy", "em", "f1", "rougel"]
    assert list(s["kilt"]) == ["KILT-accuracy", "KILT-em", "KILT-f1", "KILT-rougel"]
    assert list(s["retrieval"])[:6] == [
        "Rprec",
        "entity_in_input",
        "precision@1",
        "answer_in_context@1",
        "answer_and_ent_in_context@1",
        "entity_in_context@1",
    ]


def test_perfect_guess_scores_one(tmp_path):
    gold = _write_jsonl(tmp_path / "g.jsonl", GOLD[:3])
    guess = tmp_path / "p.jsonl"
    ids = K.read_gold_ids(gold)
    ranked = [[o["provenance"][0]["wikipedia_id"] for o in g["output"]] for g in GOLD[:3]]
    K.write_guess_file(guess, ids, ranked, [g["output"][0]["answer"] for g in GOLD[:3]])
    s = K.kilt_scores(gold, guess)
    assert s["downstream"]["accuracy"] == 1 and s["kilt"]["KILT-accuracy"] == 1
    assert s["retrieval"]["Rprec"] == 1 and s["retrieval"]["recall@5"] == 1
    assert s["downstream"]["rougel"] == pytest.approx(1, abs=1e-7)  # the rouge package's 1e-8 smoothing


def test_answer_metrics_by_hand():
    assert K.normalize_answer("The  Beatles!") == "beatles"
    assert K.normalize_answer("Washington, D.C.") == K.normalize_answer("washington DC")
    assert K.token_f1("New York", "New York City") == pytest.approx(0.8)  # p=1, r=2/3
    assert K.token_f1("Bar", "Foo") == 0
    # ROUGE-L of the rouge package: sentences cut on '.', sets of words, F with 1e-8.
    f = lambda p, r: 2.0 * ((p * r) / (p + r + 1e-8))  # noqa: E731
    assert K.rouge_l("Paris", "Paris") == f(1.0, 1.0)
    # "Washington D" | "C" vs "Washington, D" | "C": union LCS {D, C}, 3 distinct words each side
    assert K.rouge_l("Washington D.C.", "Washington, D.C.") == f(2 / 3, 2 / 3)
    # ref x y x, hyp x x y: the package backtracks left on ties and finds "x x" (one distinct
    # word), not "x y"; 2 distinct words each side.
    assert K.rouge_l("x x y", "x y x") == f(1 / 2, 1 / 2)
    assert K.rouge_l("...", "Paris") == 0.0  # package raises "Hypothesis is empty", KILT gives 0


def test_reordered_guess_gives_identical_scores(files, tmp_path):
    gold, guess = files
    shuffled = _write_jsonl(tmp_path / "shuffled.jsonl", list(reversed(GUESS)))
    assert K.kilt_scores(gold, shuffled) == K.kilt_scores(gold, guess)


# ----------------------------------------------------------------------------- writer


def test_writer_drops_padding_stringifies_and_is_ascii(tmp_path):
    out = tmp_path / "sub" / "guess.jsonl"
    ranked = np.array([[5, 3, -1], [-1, -1, -1]])
    K.write_guess_file(out, ["x1", 7], ranked, ["Café", ""])
    raw = out.read_bytes()
    assert raw.isascii()
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    assert lines[0] == {"id": "x1", "output": [{"answer": "Café", "provenance": [{"wikipedia_id": "5"}, {"wikipedia_id": "3"}]}]}
    assert lines[1] == {"id": 7, "output": [{"answer": "", "provenance": []}]}
    assert [p.name for p in out.parent.iterdir()] == ["guess.jsonl"]  # no temporary left behind


def test_writer_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError, match="one row per id; got 2, 1, 2"):
        K.write_guess_file(tmp_path / "a", ["a", "b"], [[1]], ["x", "y"])
    with pytest.raises(ValueError, match="id ' a' at rows 0 and 1"):
        K.write_guess_file(tmp_path / "a", ["a", " a"], [[1], [2]], ["x", "y"])
    with pytest.raises(ValueError, match="wikipedia_id 4 appears twice"):
        K.write_guess_file(tmp_path / "a", ["a"], [[4, 5, 4]], ["x"])
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda g, p: p.pop(), r"guess\.jsonl: no prediction for id 'G' \(.*gold\.jsonl:7\)"),
        (lambda g, p: p.append(K.guess_record("Z", [], "x")), r"guess\.jsonl:8 \(id 'Z'\): id not in gold"),
        (lambda g, p: p.append(dict(p[0])), r"guess\.jsonl:8 \(id 'E'\): duplicate id \(first at line 1\)"),
        (lambda g, p: g.append(dict(g[0])), r"gold\.jsonl:8: duplicate id 'A' \(first at line 1\)"),
        (lambda g, p: p[0]["output"].append({"answer": "y"}), r"guess\.jsonl:1 \(id 'E'\): 'output' must be a list of exactly one"),
        (lambda g, p: p[1]["output"][0].pop("provenance"), r"guess\.jsonl:2 \(id 'A'\): output\[0\] needs a 'provenance'"),
        (lambda g, p: g[1].pop("input"), r"gold\.jsonl:2 \(id 2\): gold needs an 'input'"),
        (lambda g, p: g[0]["output"][0].update(answer=" "), r"gold\.jsonl:1 \(id 'A'\): gold has no non-empty 'answer'"),
        (lambda g, p: g[0]["output"][0].update(provenance=["1"]), r"gold\.jsonl:1 \(id 'A'\): gold 'provenance' must be a list of objects"),
        (lambda g, p: g[0]["output"][0]["provenance"][0].update(title=5), r"gold\.jsonl:1 \(id 'A'\): gold provenance 'title' must be"),
        (lambda g, p: p[1]["output"][0]["provenance"].append({"wikipedia_id": "1", "text": 5}),
         r"guess\.jsonl:2 \(id 'A'\): provenance 'text' must be a string"),
    ],
)
def test_misaligned_files_are_refused_with_file_line_and_id(tmp_path, mutate, message):
    gold, guess = json.loads(json.dumps(GOLD)), json.loads(json.dumps(GUESS))
    mutate(gold, guess)
    with pytest.raises(K.KiltFileError, match=message):
        K.kilt_scores(_write_jsonl(tmp_path / "gold.jsonl", gold), _write_jsonl(tmp_path / "guess.jsonl", guess))


def test_malformed_line_and_extra_ids_allowed(tmp_path, files):
    gold, guess = files
    # a blank line is skipped, as prepare skips it (the run trained on the file): the scores are the same
    blank = tmp_path / "blank.jsonl"
    blank.write_text(guess.read_text().replace("\n", "\n\n", 1) + "\n")
    assert K.kilt_scores(gold, blank) == K.kilt_scores(gold, guess)
    marked = tmp_path / "bom.jsonl"  # so is a byte order mark opening the file
    marked.write_bytes(b"\xef\xbb\xbf" + gold.read_bytes())
    assert K.kilt_scores(marked, guess) == K.kilt_scores(gold, guess)
    # ... and errors after it still name the file's own line (a duplicate of line 1 on line 3 + 1 blank)
    lines = guess.read_text().splitlines(keepends=True)
    blank.write_text(lines[0] + "\n" + lines[1] + lines[0])
    with pytest.raises(K.KiltFileError, match=r"blank\.jsonl:4 \(id '\w+'\): duplicate id \(first at line 1\)"):
        K.kilt_scores(gold, blank)
    golds = gold.read_text().splitlines(keepends=True)
    (tmp_path / "g2.jsonl").write_text(golds[0] + "\n\n" + golds[1] + golds[0])
    with pytest.raises(K.KiltFileError, match=r"g2\.jsonl:5: duplicate id '\w+' \(first at line 1\)"):
        K.id_lines(K.read_jsonl(tmp_path / "g2.jsonl"), tmp_path / "g2.jsonl")
    # a cut line: prepare's message, with the column (json's own ended in "at" and called the newline a
    # control character)
    bad = tmp_path / "bad.jsonl"
    lines = guess.read_text().splitlines(keepends=True)
    bad.write_text(lines[0] + lines[1][:15] + "\n" + "".join(lines[2:]))
    with pytest.raises(K.KiltFileError, match=r"^\S*bad\.jsonl:2: not JSON \(Unterminated string starting at "
                                              r"column \d+\)$"):
        K.kilt_scores(gold, bad)
    bad.write_text(lines[0] + "[1, 2]\n")
    with pytest.raises(K.KiltFileError, match=r"bad\.jsonl:2: expected a JSON object, got list"):
        K.kilt_scores(gold, bad)
    extra = _write_jsonl(tmp_path / "extra.jsonl", GUESS + [{"id": "Z", "output": []}])  # unread, as in KILT
    assert K.kilt_scores(gold, extra, allow_extra_ids=True) == K.kilt_scores(gold, guess)


# ----------------------------------------------------------------------------- CLI


def test_cli_prints_and_writes_scores(files, tmp_path, capsys):
    gold, guess = files
    out = tmp_path / "scores.json"
    assert K.main(["--gold", str(gold), "--guess", str(guess), "--out", str(out), "--ks", "1,5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["downstream"]["accuracy"] == pytest.approx(3 / 7)
    assert "recall@64" not in printed["retrieval"]
    # gold as its own guess: E has two outputs, which KILT refuses in a guess -> exit 2, reason on stderr
    assert K.main(["--gold", str(gold), "--guess", str(gold)]) == 2
    assert "gold.jsonl:5 (id 'E'): 'output' must be a list of exactly one" in capsys.readouterr().err


# ----------------------------------------------------------------------------- reference


def _squad_normalize(s: str) -> str:
    """SQuAD's answer normalisation, written out here so the reference does not reuse the scorer's:
    lower case, punctuation dropped, articles a/an/the dropped, whitespace collapsed."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def _reference(gold: list[dict], guess: list[dict], ks) -> dict[str, float]:
    """A deliberately plain re-statement of KILT's EL formulas (wikipedia_id only)."""
    by_id = {str(p["id"]).strip(): p for p in guess}
    tot: dict[str, float] = {}

    def add(key, v):
        tot[key] = tot.get(key, 0.0) + v

    for g in gold:
        p = by_id[str(g["id"]).strip()]
        ranking: list[str] = []
        for prov in p["output"][0]["provenance"]:
            w = str(prov["wikipedia_id"]).strip()
            if w not in ranking:
                ranking.append(w)
        gold_lists = []
        for o in g["output"]:
            ids: list[str] = []
            for prov in o.get("provenance", []):
                if str(prov["wikipedia_id"]).strip() not in ids:
                    ids.append(str(prov["wikipedia_id"]).strip())
            gold_lists.append(ids)
        rprec = max((len(set(ranking[: len(ids)]) & set(ids)) / len(ids)) if ids else 0.0 for ids in gold_lists)
        add("Rprec", rprec)
        answers = {o["answer"].strip() for o in g["output"] if o.get("answer", "").strip()}
        ans = str(p["output"][0]["answer"]).strip()
        acc = float(bool(ans) and ans in answers)
        em = float(bool(ans) and any(_squad_normalize(ans) == _squad_normalize(a) for a in answers))
        add("accuracy", acc)
        add("em", em)
        add("KILT-accuracy", acc if bool(ans) and rprec == 1 else 0.0)
        add("KILT-em", em if bool(ans) and rprec == 1 else 0.0)
        # evidence-set ranking: labels "T" (completed), "F" (no set), "P<i>" (partial)
        sets = []
        for ids in gold_lists:
            if set(ids) not in sets:
                sets.append(set(ids))
        if not ranking:
            sets = []
        left = [set(s) for s in sets]
        labels: list[str] = []
        for w in ranking:
            hit_any = False
            for i, s in enumerate(left):
                if w in s:
                    hit_any = True
                    if f"P{i}" in labels:
                        labels.remove(f"P{i}")
                    s.remove(w)
                    labels.append("T" if not s else f"P{i}")
            if not hit_any:
                labels.append("F")
        for k in ks:
            t = labels[:k].count("T")
            add(f"precision@{k}", t / k if sets else 0.0)
            if k > 1:
                add(f"recall@{k}", t / len(sets) if sets else 0.0)
                add(f"success_rate@{k}", float(t > 0))
    return {k: v / len(gold) for k, v in tot.items()}


def _random_files(seed: int, n: int = 60) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pool = [str(x) for x in rng.sample(range(1, 40), 10)]
    names = ["Paris", "Paris, Texas", "the Paris", "Georgia", "georgia", "U.S. Open", "US Open"]
    gold, guess = [], []
    for i in range(n):
        outs = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            prov = [(rng.choice(pool), rng.choice(names)) for _ in range(rng.choice([0, 1, 1, 2]))]
            outs.append((rng.choice(names), prov))
        gold.append(_gold(rng.choice([i, f"id {i}"]), " ".join(rng.sample(names, 3)), *outs))
        ranked = [rng.choice(pool + ["900", "901"]) for _ in range(rng.choice([0, 1, 4, 12]))]
        guess.append(
            {
                "id": gold[-1]["id"],
                "output": [{"answer": rng.choice(names + [""]), "provenance": [{"wikipedia_id": w} for w in ranked]}],
            }
        )
    rng.shuffle(guess)
    return gold, guess


@pytest.mark.parametrize("seed", range(5))
def test_random_files_against_minimal_reference(tmp_path, seed):
    gold, guess = _random_files(seed)
    ks = (1, 2, 5, 10)
    got = K.kilt_scores(_write_jsonl(tmp_path / "g.jsonl", gold), _write_jsonl(tmp_path / "p.jsonl", guess), ks)
    flat = {**got["downstream"], **got["kilt"], **got["retrieval"]}
    ref = _reference(gold, guess, ks)
    assert {k: flat[k] for k in ref} == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert ref["Rprec"] > 0 and ref["recall@10"] > 0  # the random files exercise the hits


GOLDEN = Path(__file__).parent / "kilt_golden"


@pytest.mark.parametrize("case", sorted(p.name for p in GOLDEN.glob("case*")))
def test_equals_kilts_own_scripts_on_the_golden_pairs(case):
    """tests/eval/kilt_golden (README there): 20 gold/guess pairs and what facebookresearch/KILT's
    eval_downstream.evaluate and eval_retrieval.evaluate returned for them. Every value, exactly."""
    expected = json.loads((GOLDEN / case / "expected.json").read_text(encoding="utf-8"))
    ours = K.kilt_scores(GOLDEN / case / "gold.jsonl", GOLDEN / case / "guess.jsonl", ks=expected["ks"])
    assert ours["downstream"] == expected["downstream"]
    assert ours["kilt"] == expected["kilt"]
    assert ours["retrieval"] == expected["retrieval"]


def test_the_golden_pairs_are_all_there():
    assert len(list(GOLDEN.glob("case*/expected.json"))) == 20
