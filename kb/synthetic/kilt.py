"""Synthetic KILT knowledge source, KILT AIDA files and BLINK ``entity.jsonl``.

Line ``p`` of ``kilt_knowledgesource.json`` holds universe entity ``perm^-1(p)`` for a
seeded affine permutation, so same-name siblings are scattered through the file (and
across KB shards) as on Wikipedia. ``wikipedia_id`` grows with the line number, with gaps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
from pathlib import Path
from urllib.parse import quote

from tqdm import tqdm

from dist_nce.core.artifacts import write_manifest
from kb.synthetic.lexicon import KILT_DOMAINS, load_lexicon
from kb.synthetic.sink import JsonlSink
from kb.synthetic.universe import (
    GENERATOR_VERSION, T_DOC, T_MENTION, T_PERM, T_WID, AffinePermutation, Entity, Knobs, Universe, detokenize,
)

KB_FILE = "kilt_knowledgesource.json"
AIDA_FILES = {
    "train": "aidayago2-train-kilt.jsonl",
    "dev": "aidayago2-dev-kilt.jsonl",
    "test": "aidayago2-test_without_answers-kilt.jsonl",
}
BLINK_FILE = "entity.jsonl"
MANIFEST_KIND = "synthetic_kilt"
SCHEMA_VERSION = 1
START_ENT, END_ENT = "[START_ENT]", "[END_ENT]"


class _Link(str):
    """A token that is another entity's name; becomes an ``anchors`` entry."""

    target: int


class KiltUniverse:
    """A :class:`Universe` laid out as a KILT knowledge source (positions and ids)."""

    def __init__(self, seed: int, num_entities: int, knobs: Knobs, vocab_path: str | os.PathLike | None = None):
        self.u = Universe(seed, num_entities, KILT_DOMAINS, load_lexicon(vocab_path), knobs, salt="kilt")
        self._perm = AffinePermutation(self.u.h(T_PERM), num_entities)

    @property
    def n(self) -> int:
        return self.u.n

    def position(self, i: int) -> int:
        """Line number (0-based) of entity ``i``; phantoms (``i >= n``) get ``i``."""
        return self._perm(i) if i < self.n else i

    def index_at(self, p: int) -> int:
        return self._perm.inverse(p)

    def wikipedia_id(self, i: int) -> str:
        p = self.position(i)
        return str(12 + 10 * p + self.u.h(T_WID, p) % 10)

    def title(self, i: int) -> str:
        start, size = self.u.group(i)
        return self.u.group_titles(start, size)[i - start][0]

    def page(self, i: int) -> tuple[dict, Entity]:
        """The knowledge-source object of entity ``i`` (and the entity)."""
        u, e = self.u, self.u.entity(i)
        rng = random.Random(u.h(T_DOC, i))
        wid = self.wikipedia_id(i)
        links = []
        for _ in range(rng.choice((0, 1, 1, 2))):
            link = _Link(u.name(u.group(j := rng.randrange(self.n))[0]))
            link.target = j
            links.append(link)
        paras = u.description(e, rng, links)
        text = [e.title + "\n", detokenize(paras[0]) + "\n"]
        if rng.random() < 0.5:
            text.append(f"Section::::{rng.choice(e.domain.words).capitalize()}.\n")
        para, spans = _detokenize_links(paras[1])
        anchors = []
        for link, s, t in spans:
            target = self.title(link.target)
            anchors.append({"paragraph_id": len(text), "start": s, "end": t, "text": str(link),
                            "href": quote(target, safe="()"), "wikipedia_title": target,
                            "wikipedia_id": self.wikipedia_id(link.target)})
        text.append(para + "\n")
        revid = 900_000_000 + u.h(T_DOC, i, 1) % 10_000_000
        page = {
            "_id": wid,
            "wikipedia_id": wid,
            "wikipedia_title": e.title,
            "text": text,
            "anchors": anchors,
            "categories": _categories(e, u.topic_words(e.topic)[0], rng),
            "history": {
                "revid": revid,
                "timestamp": f"2019-0{1 + rng.randrange(7)}-{1 + rng.randrange(28):02d}T"
                             f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z",
                "parentid": revid - 1 - rng.randrange(100_000),
                "pre_dump": rng.random() < 0.9,
                "pageid": int(wid),
                "url": f"https://en.wikipedia.org/w/index.php?title={quote(e.title.replace(' ', '_'))}&oldid={revid}",
            },
        }
        if rng.random() < 0.9:  # real lines lack wikidata_info now and then
            page["wikidata_info"] = {
                "wikidata_id": f"Q{1000 + u.h(T_DOC, i, 2) % 90_000_000}",
                "wikidata_label": e.name,
                "description": _short_description(e),
                "aliases": [e.alias],
                "wikipedia_title": e.title,
            }
            if rng.random() < 0.05:
                page["wikidata_info"]["enwikiquote_title"] = e.title
        return page, e

    def mention(self, split: int, k: int, missing_gold: float, title_drift: float) -> tuple[dict, dict]:
        """The ``k``-th AIDA record of ``split`` with its gold, and facts for the counts."""
        u, knobs = self.u, self.u.k
        rng = random.Random(u.h(T_MENTION, split, k))
        missing = rng.random() < missing_gold
        # Phantoms share the generative story but no KB line; n//100 of them keeps repeats rare.
        g = self.n + rng.randrange(max(8, self.n // 100)) if missing else u.pick_gold(rng)
        e = u.entity(g)
        mention = u.surface(e, rng, knobs.partial_name, knobs.alias)
        left, right = u.context(e, rng, "left"), u.context(e, rng, "right")
        edge = rng.random()
        if edge < knobs.edge:
            left = []
        elif edge < 2 * knobs.edge:
            right = []
        drifted = not missing and u.drifted(g, title_drift)
        title = e.old_title if drifted else e.title
        left_s, right_s = " ".join(left), " ".join(right)
        record = {
            "id": f"synth-aida-{('train', 'dev', 'test')[split]}-{k}",
            "input": " ".join(x for x in (left_s, START_ENT, mention, END_ENT, right_s) if x),
            "output": [{"answer": title, "provenance": [{"wikipedia_id": self.wikipedia_id(g), "title": title}]}],
            "meta": {"left_context": left_s, "mention": mention, "right_context": right_s},
        }
        return record, {"missing": missing, "drifted": drifted}


def _detokenize_links(tokens: list[str]) -> tuple[str, list[tuple[_Link, int, int]]]:
    """Like :func:`detokenize`, also returning the character span of every link.

    Links are fenced with control characters (never in generated text) through the
    fast join, then the fences are removed while their offsets are recorded.
    """
    links = [t for t in tokens if isinstance(t, _Link)]
    if not links:
        return detokenize(tokens), []
    text = detokenize([f"\x00{t}\x01" if isinstance(t, _Link) else t for t in tokens])
    parts, spans, pos, cut = [], [], 0, 0
    for link in links:
        a = text.index("\x00", cut)
        b = text.index("\x01", a)
        parts.append(text[cut:a])
        pos += a - cut
        spans.append((link, pos, pos + b - a - 1))
        parts.append(text[a + 1:b])
        pos += b - a - 1
        cut = b + 1
    parts.append(text[cut:])
    return "".join(parts), spans


def _plural(q: str) -> str:
    return q[:-3] + "men" if q.endswith("man") else q + "s"


def _categories(e: Entity, topic_word: str, rng: random.Random) -> str:
    if rng.random() < 0.05:
        return ""
    first = f"{e.year} births" if e.domain.style == "person" else f"{e.year} {_plural(e.domain.qualifier)}"
    return ",".join((first, f"{topic_word.capitalize()} {_plural(e.domain.qualifier)}", "Synthetic pages"))


def _short_description(e: Entity) -> str:
    if e.domain.style == "person":
        return f"{e.domain.qualifier} (born {e.year})"
    return f"{e.year} {e.domain.qualifier}"


_CHUNK = 2048
_worker_universe: "KiltUniverse | None" = None  # set only inside pool worker processes


def _render_chunk(ku: KiltUniverse, lo: int, hi: int, blink: bool) -> tuple[bytes, bytes]:
    """KB (and BLINK) lines for positions ``[lo, hi)``, encoded."""
    kb, bl = [], []
    for p in range(lo, hi):
        page, e = ku.page(ku.index_at(p))
        kb.append(json.dumps(page, ensure_ascii=False))
        if blink:
            bl.append(json.dumps({
                "text": " " + " ".join(t.strip() for t in page["text"][1:] if not t.startswith("Section::::")),
                "idx": f"https://en.wikipedia.org/wiki?curid={page['wikipedia_id']}",
                "title": e.title,
                "entity": e.title,
            }, ensure_ascii=False))
    return "".join(x + "\n" for x in kb).encode("utf-8"), "".join(x + "\n" for x in bl).encode("utf-8")


def _init_worker(spec: tuple) -> None:
    global _worker_universe
    _worker_universe = KiltUniverse(*spec)


def _render_in_worker(task: tuple[int, int, bool]) -> tuple[bytes, bytes]:
    assert _worker_universe is not None
    return _render_chunk(_worker_universe, *task)


def kilt_settings(num_entities: int, num_train: int, num_dev: int, num_test: int, seed: int = 0, *,
                  blink: bool = False, title_drift: float = 0.03, missing_gold: float = 0.0,
                  knobs: Knobs = Knobs(), lexicon_sha256: str) -> dict:
    """Everything the files :func:`write_kilt` writes depend on, as JSON (``workers`` and
    ``progress`` change nothing); recorded as the manifest's ``settings``."""
    return json.loads(json.dumps({
        "generator": GENERATOR_VERSION, "seed": seed, "num_entities": num_entities,
        "num_mentions": {"train": num_train, "dev": num_dev, "test": num_test}, "blink": blink,
        "title_drift": title_drift, "missing_gold": missing_gold, "knobs": dataclasses.asdict(knobs),
        "lexicon_sha256": lexicon_sha256,
    }))


def kilt_files(blink: bool = False) -> list[str]:
    """The data files :func:`write_kilt` may write, relative to its directory (an AIDA
    split asked for 0 mentions gets no file: an empty split file is an error to kb.prepare)."""
    return [KB_FILE, *AIDA_FILES.values(), *([BLINK_FILE] if blink else [])]


def write_kilt(
    out_dir: str | os.PathLike,
    num_entities: int,
    num_train: int,
    num_dev: int,
    num_test: int,
    seed: int = 0,
    *,
    blink: bool = False,
    title_drift: float = 0.03,
    missing_gold: float = 0.0,
    knobs: Knobs = Knobs(),
    vocab_path: str | os.PathLike | None = None,
    progress: bool | None = None,
    workers: int = 1,
) -> dict[str, Path]:
    """Write a synthetic KILT knowledge source and AIDA files (and BLINK ``entity.jsonl``).

    title_drift: fraction of entities whose AIDA gold title is an outdated one (the
      ``wikipedia_id`` still resolves it). missing_gold: fraction of labelled mentions
      whose gold has no KB line. progress: tqdm bar (default: for >= 100k entities).
    workers: processes rendering KB lines (each line is a pure function of its
      position, so the output does not depend on this).
    Returns ``{"kb", "train", "dev", "test"[, "blink"], "manifest"}`` paths.
    """
    for name, rate in (("title_drift", title_drift), ("missing_gold", missing_gold)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {rate}")
    if min(num_train, num_dev, num_test) < 0 or workers < 1:
        raise ValueError("mention counts must be >= 0 and workers >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ku = KiltUniverse(seed, num_entities, knobs, vocab_path)
    num_mentions = {"train": num_train, "dev": num_dev, "test": num_test}
    paths = {"kb": out / KB_FILE, **{s: out / f for s, f in AIDA_FILES.items() if num_mentions[s] > 0}}
    if blink:
        paths["blink"] = out / BLINK_FILE
    show = num_entities >= 100_000 if progress is None else progress
    counts: dict = {"entities": num_entities}
    tasks = [(lo, min(lo + _CHUNK, num_entities), blink) for lo in range(0, num_entities, _CHUNK)]
    with contextlib.ExitStack() as stack:
        sinks = {key: JsonlSink(stack, p) for key, p in paths.items()}
        bar = stack.enter_context(tqdm(total=num_entities, desc="synthetic KILT entities", unit="ent",
                                       disable=not show, mininterval=2.0))
        if workers > 1:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                workers, _init_worker, ((seed, num_entities, knobs, vocab_path),)))
            chunks = pool.imap(_render_in_worker, tasks)
        else:
            chunks = (_render_chunk(ku, *task) for task in tasks)
        for (lo, hi, _), (kb_lines, blink_lines) in zip(tasks, chunks):
            sinks["kb"].write_encoded(kb_lines, hi - lo)
            if blink:
                sinks["blink"].write_encoded(blink_lines, hi - lo)
            bar.update(hi - lo)
        for split, (name, num) in enumerate((("train", num_train), ("dev", num_dev), ("test", num_test))):
            c = {"mentions": num, "missing_gold": 0, "title_drift": 0}
            for k in range(num):
                record, facts = ku.mention(split, k, missing_gold, title_drift)
                if name == "test":
                    del record["output"]
                else:
                    c["missing_gold"] += facts["missing"]
                    c["title_drift"] += facts["drifted"]
                sinks[name].write(record)  # num > 0, so the split has its sink
            counts[name] = c
    files = {p.name: s.summary() for p, s in ((s.path, s) for s in sinks.values())}
    settings = kilt_settings(num_entities, num_train, num_dev, num_test, seed, blink=blink, title_drift=title_drift,
                             missing_gold=missing_gold, knobs=knobs, lexicon_sha256=ku.u.lex.sha256)
    write_manifest(
        out, MANIFEST_KIND, SCHEMA_VERSION, settings=settings, seed=seed, num_entities=num_entities,
        num_mentions={"train": num_train, "dev": num_dev, "test": num_test}, blink=blink,
        title_drift=title_drift, missing_gold=missing_gold, knobs=dataclasses.asdict(knobs),
        num_topics=ku.u.num_topics, lexicon={"source": ku.u.lex.source, "sha256": ku.u.lex.sha256},
        counts=counts, files=files,
    )
    paths["manifest"] = out / "manifest.json"
    return paths
