"""KILT prediction files and KILT's own entity-linking scores, reproduced exactly.

A guess file has one JSON line per gold id::

    {"id": <as in gold>, "output": [{"answer": "<predicted title>",
                                     "provenance": [{"wikipedia_id": "<id>"}, ...ranked]}]}

The scorer reproduces what facebookresearch/KILT's ``kilt/eval_downstream.py`` and
``kilt/eval_retrieval.py`` print, to the last digit (same formulas, same summation
order, no rounding). For entity linking the interesting numbers are:

- ``downstream.accuracy``: the stripped guess answer is *exactly* one of the stripped gold
  answers (no normalisation: a title that drifted in case or punctuation is a miss).
- ``downstream.em`` / ``f1``: SQuAD-style normalised match / token F1 (lower-case, drop
  punctuation and the articles a/an/the, squash whitespace); ``rougel``: ROUGE-L F of the
  ``rouge`` PyPI package (no normalisation), max over gold answers.
- ``Rprec``: for each gold output with R distinct ids, |top-R guess ids ∩ gold ids| / R;
  the max over gold outputs. Guess ids are deduplicated first (first occurrence wins).
- ``kilt.KILT-*``: the downstream value, counted only where Rprec == 1.
- ``precision@k``, ``recall@k``, ``success_rate@k``: each gold output's provenance is one
  *evidence set*; walking down the guess ranking, a set becomes a hit at the position where
  its last page appears (earlier partial positions are withdrawn). precision@k = hits in
  the first k positions / k; recall@k = hits / number of distinct evidence sets;
  success_rate@k = 1 if any hit. KILT reports recall@k and success_rate@k only for k > 1
  (at k = 1 use precision@1, which equals recall@1 with one evidence set, as in AIDA).
- Every value is a sum over items in gold order divided by the number of items.

Alignment follows KILT where it is strict and is stricter where KILT only warns: every
gold id needs exactly one guess (matched on ``str(id).strip()``; guess order is free, as
KILT reorders), and guess ids absent from gold are an error unless ``allow_extra_ids``
(KILT prints a warning and ignores them). Inputs that KILT's scripts crash on or score only in
part are refused up front with the file, line and id: a gold item without an answer (eval_downstream
takes a max over no answers unless the guess answer is empty too), no ``input``, a guess without
exactly one output with ``answer`` and ``provenance`` (eval_retrieval asserts on a missing
provenance, eval_downstream counts it as R-precision 0).

CLI::

    python -m dist_nce.eval.kilt --gold aidayago2-dev-kilt.jsonl --guess dev_guess.jsonl --out scores.json
"""
from __future__ import annotations

import argparse
import json
import re
import string
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from dist_nce.core.artifacts import atomic_path, atomic_write_json

DEFAULT_KS = (1, 5, 10, 20, 64, 100)
RANK_KEYS = ("wikipedia_id",)


class KiltFileError(ValueError):
    """A gold or guess file KILT's scripts would reject or mis-score."""


# --------------------------------------------------------------------------- files


class JsonlRecords(list):
    """The records of a JSON-lines file, with ``lines``: each one's line number in it (blank lines skipped)."""

    lines: list[int]


def line_numbers(records: list[dict]) -> list[int]:
    """Each record's line in its file: :class:`JsonlRecords`' own, else 1..n (records made in memory)."""
    return getattr(records, "lines", None) or list(range(1, len(records) + 1))


def read_jsonl(path: str | Path) -> JsonlRecords:
    """One JSON object per line (KILT's ``load_data``); errors name ``path:line``. Blank lines are skipped,
    as ``jobs/prepare_kb.py`` skips them: a file the run trained on is scored, not refused at its end."""
    from kb.jsonl import BadRecord, load_object

    records = JsonlRecords()
    records.lines = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = load_object(line, str(path), lineno)
            except BadRecord as e:
                raise KiltFileError(str(e)) from None
            if "id" not in rec:
                raise KiltFileError(f"{path}:{lineno}: expected a JSON object with an 'id'")
            records.append(rec)
            records.lines.append(lineno)
    return records


def read_gold_ids(path: str | Path) -> list[Any]:
    """The ids of a KILT file, in file order and with their JSON types (for the writer)."""
    return [r["id"] for r in read_jsonl(path)]


def guess_record(id_: Any, ranked_wikipedia_ids: Iterable[Any], answer: str) -> dict:
    """One guess line. Padding (int ``-1`` or None) is dropped; ids become strings."""
    prov, seen = [], set()
    for wid in ranked_wikipedia_ids:
        if wid is None or (not isinstance(wid, str) and int(wid) == -1):
            continue
        s = str(wid).strip() if isinstance(wid, str) else str(int(wid))
        if s in seen:
            # KILT would silently deduplicate and shift every later rank: refuse instead.
            raise ValueError(f"id {id_!r}: wikipedia_id {s} appears twice in the ranking")
        seen.add(s)
        prov.append({"wikipedia_id": s})
    return {"id": id_, "output": [{"answer": str(answer), "provenance": prov}]}


def write_guess_file(
    path: str | Path, ids: Sequence[Any], ranked_wikipedia_ids: Sequence[Iterable[Any]], answers: Sequence[str]
) -> None:
    """Write a KILT guess file atomically, one line per id, in the order given.

    Args:
        ids: [N] the gold ids, exactly as in the gold file (see :func:`read_gold_ids`).
        ranked_wikipedia_ids: [N, k] ranked candidates (array or lists), ``-1`` = padding.
        answers: [N] the predicted title (normally the KB title of the top-1 candidate).

    Lines are ASCII JSON (``ensure_ascii``), so KILT's locale-dependent ``open`` reads them.
    """
    if not (len(ids) == len(ranked_wikipedia_ids) == len(answers)):
        raise ValueError(
            f"{path}: ids, ranked_wikipedia_ids, answers must have one row per id; "
            f"got {len(ids)}, {len(ranked_wikipedia_ids)}, {len(answers)}"
        )
    seen: dict[str, int] = {}
    for i, id_ in enumerate(ids):
        key = str(id_).strip()
        if key in seen:
            raise ValueError(f"{path}: id {id_!r} at rows {seen[key]} and {i}; KILT needs unique ids")
        seen[key] = i
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="ascii") as f:
            for id_, row, ans in zip(ids, ranked_wikipedia_ids, answers):
                row = row.tolist() if hasattr(row, "tolist") else row
                f.write(json.dumps(guess_record(id_, row, ans)) + "\n")


def _key(rec: dict) -> str:
    return str(rec["id"]).strip()


def id_lines(records: list[dict], path: str | Path) -> dict[str, int]:
    """{id as KILT compares it: line in ``path``} of ``read_jsonl(path)``; a repeated id is an error naming
    both lines (KILT keys its guesses by id: the second would silently take the first one's score)."""
    lines: dict[str, int] = {}
    for lineno, rec in zip(line_numbers(records), records):
        if _key(rec) in lines:
            raise KiltFileError(f"{path}:{lineno}: duplicate id {rec['id']!r} (first at line {lines[_key(rec)]})")
        lines[_key(rec)] = lineno
    return lines


def check_gold(gold: list[dict], gold_path: str | Path = "gold") -> dict[str, int]:
    """Refuse a labelled gold file KILT's scripts would crash on or mis-score (file, line and id); returns
    :func:`id_lines` of it."""
    for lineno, g in zip(line_numbers(gold), gold):
        where = f"{gold_path}:{lineno} (id {g['id']!r})"
        outs = g.get("output")
        if not isinstance(outs, list) or not outs or not all(isinstance(o, dict) for o in outs):
            raise KiltFileError(f"{where}: gold needs a non-empty 'output' list of objects")
        if any("answer" in o and not isinstance(o["answer"], str) for o in outs):
            raise KiltFileError(f"{where}: gold 'answer' must be a string")
        if not _gold_answers(g):
            raise KiltFileError(f"{where}: gold has no non-empty 'answer' (KILT cannot score it)")
        provs = [o.get("provenance", []) for o in outs]
        if any(not isinstance(pv, list) or not all(isinstance(x, dict) for x in pv) for pv in provs):
            raise KiltFileError(f"{where}: gold 'provenance' must be a list of objects")
        if any(not isinstance(x.get("title", ""), str) for pv in provs for x in pv):
            raise KiltFileError(f"{where}: gold provenance 'title' must be a string")
        if not isinstance(g.get("input"), str):
            raise KiltFileError(f"{where}: gold needs an 'input' string (KILT's entity_in_input reads it)")
    return id_lines(gold, gold_path)


def align(
    gold: list[dict],
    guess: list[dict],
    gold_path: str = "gold",
    guess_path: str = "guess",
    allow_extra_ids: bool = False,
) -> list[dict]:
    """Check both files for KILT and return the guess records in gold order."""
    gold_line = check_gold(gold, gold_path)
    by_id: dict[str, dict] = {}
    guess_line: dict[str, int] = {}
    for lineno, p in zip(line_numbers(guess), guess):
        where = f"{guess_path}:{lineno} (id {p['id']!r})"
        if _key(p) in by_id:
            raise KiltFileError(f"{where}: duplicate id (first at line {guess_line[_key(p)]})")
        by_id[_key(p)] = p
        guess_line[_key(p)] = lineno
        if _key(p) not in gold_line:
            if allow_extra_ids:
                continue  # KILT ignores them unread
            raise KiltFileError(f"{where}: id not in gold file {gold_path}")
        outs = p.get("output")
        if not (isinstance(outs, list) and len(outs) == 1 and isinstance(outs[0], dict) and "answer" in outs[0]):
            raise KiltFileError(f"{where}: 'output' must be a list of exactly one object with an 'answer'")
        prov = outs[0].get("provenance")
        if not (isinstance(prov, list) and all(isinstance(x, dict) for x in prov)):
            raise KiltFileError(f"{where}: output[0] needs a 'provenance' list of objects (may be empty)")
        if any(not isinstance(x.get("text", ""), str) for x in prov):
            raise KiltFileError(f"{where}: provenance 'text' must be a string")
    for lineno, g in zip(line_numbers(gold), gold):
        if _key(g) not in by_id:
            raise KiltFileError(f"{guess_path}: no prediction for id {g['id']!r} ({gold_path}:{lineno})")
    return [by_id[_key(g)] for g in gold]


# --------------------------------------------------------------------------- answers


_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD/KILT normalisation: lower-case, drop punctuation, drop a/an/the, squash spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _gold_answers(gold: dict) -> set[str]:
    return {o["answer"].strip() for o in gold["output"] if o.get("answer") and o["answer"].strip()}


def _gold_titles(gold: dict) -> set[str]:
    return {
        p["title"].strip()
        for o in gold["output"]
        for p in o.get("provenance", ())
        if p.get("title") and p["title"].strip()
    }


def token_f1(pred: str, gold: str) -> float:
    """Token F1 of the normalised strings (KILT's ``f1``); 0 without common tokens."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0
    precision, recall = 1.0 * same / len(p), 1.0 * same / len(g)
    return (2 * precision * recall) / (precision + recall)


def _sentences(text: str) -> list[str]:
    # The rouge package cuts on '.', drops empty pieces, then squashes whitespace inside.
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """Words of the LCS of ref and hyp, backtracked like the rouge package (ties go left)."""
    n, m = len(ref), len(hyp)
    t = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            t[i][j] = t[i - 1][j - 1] + 1 if ref[i - 1] == hyp[j - 1] else max(t[i - 1][j], t[i][j - 1])
    words, i, j = set(), n, m
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif t[i - 1][j] > t[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(pred: str, gold: str) -> float:
    """ROUGE-L F as KILT gets it from ``rouge.Rouge().get_scores(pred, gold)``.

    Summary-level union-LCS over '.'-separated sentences, counted on *sets* of words
    (the package's default ``exclusive=True``); 0.0 when either side has no sentence.
    """
    hyp, ref = _sentences(pred), _sentences(gold)
    if not hyp or not ref:
        return 0.0  # the package raises ValueError and KILT scores 0.0
    hyp_words = [s.split(" ") for s in hyp]
    union: set[str] = set()
    for r in ref:
        for h in hyp_words:
            union |= _lcs_words(r.split(" "), h)
    n_ref = len({w for s in ref for w in s.split(" ")})
    n_hyp = len({w for h in hyp_words for w in h})
    r_lcs, p_lcs = len(union) / n_ref, len(union) / n_hyp
    return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))


# --------------------------------------------------------------------------- provenance


def _provenance_ids(output: dict, rank_keys: Sequence[str]) -> list[str]:
    """Distinct ids of one output's provenance, in order; entries missing a key are skipped."""
    ids: list[str] = []
    for p in output.get("provenance", ()):
        if all(k in p for k in rank_keys):
            s = "+".join(str(p[k]).strip() for k in rank_keys)
            if s not in ids:
                ids.append(s)
    return ids


def r_precision(guess: dict, gold: dict, rank_keys: Sequence[str] = RANK_KEYS) -> float:
    """Max over gold outputs of |guess[:R] ∩ gold| / R (0 for an output without ids)."""
    ranked = _provenance_ids(guess["output"][0], rank_keys)
    best = []
    for out in gold["output"]:
        ids = _provenance_ids(out, rank_keys)
        best.append(sum(1 for x in ranked[: len(ids)] if x in ids) / len(ids) if ids else 0)
    return max(best)


def evidence_rank(guess: dict, gold: dict, rank_keys: Sequence[str] = RANK_KEYS) -> tuple[list, int]:
    """KILT's rank of evidence sets and the number of distinct sets.

    The rank holds True (a set completed at this position), False (a page in no set) and
    ``("partial", idx)`` (set idx partly seen, at its latest position). A page in several
    sets yields one entry per set. Markers are tuples, never ints, because 1 == True and
    0 == False would corrupt ``count(True)``."""
    ranked = _provenance_ids(guess["output"][0], rank_keys)
    if not ranked:
        return [], 0
    sets: list[set[str]] = []
    for out in gold["output"]:
        if "provenance" in out:
            s = {"+".join(str(p[k]).strip() for k in rank_keys if k in p) for p in out["provenance"]}
            if s not in sets:
                sets.append(s)
    n_sets = len(sets)
    rank: list = []
    for page in ranked:
        found = False
        for idx, s in enumerate(sets):
            if page in s:
                found = True
                marker = ("partial", idx)
                if marker in rank:  # withdraw the earlier partial position of this set
                    rank.remove(marker)
                s.discard(page)
                rank.append(True if not s else marker)
        if not found:
            rank.append(False)
    return rank, n_sets


def _in_context(guess: dict, k: int, needles: set[str], also: set[str] | None = None) -> int:
    """1 if a normalised needle occurs in the ``text`` of one of the first k guess provenances
    (and, with ``also``, a normalised ``also`` string in that same text)."""
    prov = guess["output"][0].get("provenance", [])
    for p in prov[: min(k, len(prov))]:
        if "text" in p:
            text = normalize_answer(p["text"])
            if any(normalize_answer(x) in text for x in needles):
                if also is None or any(normalize_answer(t) in text for t in also):
                    return 1
    return 0


def retrieval_scores(
    gold: list[dict], guess: list[dict], ks: Sequence[int] = DEFAULT_KS, rank_keys: Sequence[str] = RANK_KEYS
) -> dict[str, float]:
    """``kilt/eval_retrieval.py`` output for aligned records (same keys, same order)."""
    ks = sorted(int(k) for k in ks)
    if not ks or ks[0] < 1 or len(set(ks)) != len(ks):
        raise ValueError(f"ks: expected distinct positive integers, got {ks}")
    names = ["Rprec", "entity_in_input"]
    for k in ks:
        names += [f"precision@{k}", f"answer_in_context@{k}", f"answer_and_ent_in_context@{k}"]
        names += [f"entity_in_context@{k}"]
        names += [f"recall@{k}", f"success_rate@{k}"] if k > 1 else []
    res = dict.fromkeys(names, 0.0)
    for p, g in zip(guess, gold):
        res["Rprec"] += r_precision(p, g, rank_keys)
        titles, answers = _gold_titles(g), _gold_answers(g)
        text = normalize_answer(g["input"])
        res["entity_in_input"] += int(any(normalize_answer(t) in text for t in titles))
        rank, n_sets = evidence_rank(p, g, rank_keys)
        for k in ks:
            hits = rank[:k].count(True)
            res[f"precision@{k}"] += hits / k if n_sets else 0
            res[f"answer_in_context@{k}"] += _in_context(p, k, answers)
            res[f"answer_and_ent_in_context@{k}"] += _in_context(p, k, answers, titles)
            res[f"entity_in_context@{k}"] += _in_context(p, k, titles)
            if k > 1:
                res[f"recall@{k}"] += hits / n_sets if n_sets else 0
                res[f"success_rate@{k}"] += int(True in rank[:k]) if n_sets else 0
    if guess:
        for name in names:
            res[name] /= len(guess)
    return res


def downstream_scores(gold: list[dict], guess: list[dict], rank_keys: Sequence[str] = RANK_KEYS) -> dict[str, dict]:
    """``kilt/eval_downstream.py``'s "downstream" and "kilt" blocks for aligned records."""
    acc = em = f1 = rl = 0
    k_acc = k_em = k_f1 = k_rl = 0
    for p, g in zip(guess, gold):
        answer = str(p["output"][0]["answer"]).strip()
        if not answer:
            continue  # KILT counts an empty answer as wrong everywhere
        golds = _gold_answers(g)
        a = 1 if answer in golds else 0
        e = max(normalize_answer(answer) == normalize_answer(x) for x in golds)
        f = max(token_f1(answer, x) for x in golds)
        r = max(rouge_l(answer, x) for x in golds)
        acc, em, f1, rl = acc + a, em + e, f1 + f, rl + r
        if r_precision(p, g, rank_keys) == 1:
            k_acc, k_em, k_f1, k_rl = k_acc + a, k_em + e, k_f1 + f, k_rl + r
    n = len(guess)
    if n:
        acc, em, f1, rl, k_acc, k_em, k_f1, k_rl = (x / n for x in (acc, em, f1, rl, k_acc, k_em, k_f1, k_rl))
    return {
        "kilt": {"KILT-accuracy": k_acc, "KILT-em": k_em, "KILT-f1": k_f1, "KILT-rougel": k_rl},
        "downstream": {"accuracy": acc, "em": em, "f1": f1, "rougel": rl},
    }


def kilt_scores(
    gold_path: str | Path, guess_path: str | Path, ks: Sequence[int] = DEFAULT_KS, allow_extra_ids: bool = False
) -> dict[str, dict]:
    """Score a guess file as KILT does: {"downstream", "kilt", "retrieval"}.

    "downstream" and "kilt" equal ``eval_downstream.py``'s blocks; "retrieval" equals
    ``eval_retrieval.py --ks <ks>`` (with identical values; it holds ``eval_downstream.py``'s Rprec,
    and its recall@5 where ``ks`` has 5, as the default does).
    """
    gold = read_jsonl(gold_path)
    guess = align(gold, read_jsonl(guess_path), str(gold_path), str(guess_path), allow_extra_ids)
    return {**downstream_scores(gold, guess), "retrieval": retrieval_scores(gold, guess, ks)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dist_nce.eval.kilt", description="Score a KILT guess file like KILT.")
    ap.add_argument("--gold", required=True, help="gold KILT jsonl (e.g. aidayago2-dev-kilt.jsonl)")
    ap.add_argument("--guess", required=True, help="guess KILT jsonl, one line per gold id")
    ap.add_argument("--out", help="also write the scores to this JSON file (atomically)")
    ap.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="comma-separated k for precision/recall@k")
    ap.add_argument("--allow-extra-ids", action="store_true", help="ignore guess ids absent from gold (KILT warns)")
    args = ap.parse_args(argv)
    try:
        ks = [int(k) for k in args.ks.split(",")]
        scores = kilt_scores(args.gold, args.guess, ks, args.allow_extra_ids)
    except (KiltFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(scores, indent=2))
    if args.out:
        atomic_write_json(args.out, scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
