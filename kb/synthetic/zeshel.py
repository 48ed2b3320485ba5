"""Synthetic Zeshel: ``documents/<world>.json`` and ``mentions/<split>.json``.

Each world is its own universe (own names, topics, entity kinds), so train, val and
test worlds share no entity: the zero-shot setting. Mentions are hyperlinks inside
the world's documents: document ``d`` is its title, its own description, then one
passage per outgoing link, and a mention's ``start_index``/``end_index`` are inclusive
whitespace-token positions of the link text in ``d``'s text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Mapping, Sequence

from tqdm import tqdm

from dist_nce.core.artifacts import write_manifest
from kb.synthetic.lexicon import ZESHEL_WORLD_TABLE, Domain, Lexicon, load_lexicon
from kb.synthetic.sink import JsonlSink
from kb.synthetic.universe import (
    GENERATOR_VERSION, T_DOC, T_LINK, T_PERM, T_SPLIT, AffinePermutation, Knobs, Universe, hash64, mix64, unit,
)
from kb.zeshel import ZESHEL_SPLITS, ZESHEL_WORLDS

SPLITS = ZESHEL_SPLITS
_WORLD_SPLIT = {w: split for split, worlds in ZESHEL_WORLDS.items() for w in worlds}
_WORLD_INDEX = {w: i for i, w in enumerate(_WORLD_SPLIT)}
MANIFEST_KIND = "synthetic_zeshel"
SCHEMA_VERSION = 1
# Zeshel's defaults: mentions are mostly not the page title verbatim.
ZESHEL_KNOBS = Knobs(partial_name=0.15, alias=0.30, context_words=(15, 40))


def zeshel_category(mention: str, title: str) -> str:
    """Zeshel's mention categories (Logeswaran et al. 2019, section 6)."""
    m, t = mention.lower(), title.lower()
    if m == t:
        return "HIGH_OVERLAP"
    if t.startswith(m + " ("):
        return "MULTIPLE_CATEGORIES"
    if m in t:
        return "AMBIGUOUS_SUBSTRING"
    return "LOW_OVERLAP"


def _hex_id(key: int) -> str:
    """16 upper-case hex digits, as Zeshel ids are; injective in ``key`` (mix64 is a bijection)."""
    return f"{mix64(key):016X}"


class _World:
    """One world laid out as Zeshel documents: ids, document order, links per document."""

    def __init__(self, seed: int, world: str, index: int, num_docs: int, num_mentions: int,
                 lexicon: Lexicon, knobs: Knobs):
        if num_docs < 2:
            raise ValueError(f"world {world}: need at least 2 documents, got {num_docs}")
        split, (kinds, words) = _WORLD_SPLIT[world], ZESHEL_WORLD_TABLE[world]
        domains = [Domain(k, k, "plain", (k, *words)) for k in kinds]
        self.name, self.split, self.index = world, split, index
        self.u = Universe(seed, num_docs, domains, lexicon, knobs, salt=f"zeshel/{world}", extra_words=words)
        self.id_base = hash64(seed, 0x2E5E1)
        self.num_mentions = num_mentions
        n = num_docs
        self._per_doc, self._extra = divmod(num_mentions, n)
        self.order = AffinePermutation(self.u.h(T_PERM), n)  # file line p holds document order.inverse(p)
        self._rank = AffinePermutation(self.u.h(T_PERM, 1), n)

    def doc_id(self, d: int) -> str:
        return _hex_id(self.id_base ^ ((self.index << 32) | d))

    def mention_id(self, serial: int) -> str:
        return _hex_id(self.id_base ^ ((1 << 63) | (self.index << 32) | serial))

    def links_of(self, d: int) -> int:
        # The remainder goes to a pseudo-random subset of exactly `extra` documents.
        return self._per_doc + (1 if self._rank(d) < self._extra else 0)

    def split_of(self, gold: int, d: int, k: int, seen: float, unseen: float) -> str:
        if self.split != "train":
            return self.split
        if unit(self.u.h(T_SPLIT, gold)) < unseen:  # the gold is never a train label
            return "heldout_train_unseen"
        return "heldout_train_seen" if unit(self.u.h(T_SPLIT, gold, d, k)) < seen else "train"

    def document(self, d: int, seen: float, unseen: float) -> tuple[dict, list[tuple[str, dict]]]:
        """Document ``d`` and its mentions as (split, record) pairs."""
        u = self.u
        e = u.entity(d)
        rng = random.Random(u.h(T_DOC, d))
        words = e.title.split()
        for para in u.description(e, rng):
            words.extend(" ".join(para).split())
        mentions = []
        for k in range(self.links_of(d)):
            lrng = random.Random(u.h(T_LINK, d, k))
            g = u.pick_gold(lrng)
            if g == d:
                g = (g + 1) % u.n
            gold = u.entity(g)
            surface = u.surface(gold, lrng, u.k.partial_name, u.k.alias)
            left, right = u.context(gold, lrng, "left"), u.context(gold, lrng, "right")
            words.extend(" ".join(left).split())
            start = len(words)
            words.extend(surface.split())
            end = len(words) - 1
            words.extend(" ".join(right).split())
            mentions.append((self.split_of(g, d, k, seen, unseen), {
                "mention_id": None,  # numbered by the writer, in file order
                "context_document_id": self.doc_id(d),
                "corpus": self.name,
                "start_index": start,
                "end_index": end,
                "text": surface,
                "label_document_id": self.doc_id(g),
                "category": zeshel_category(surface, gold.title),
            }))
        return {"document_id": self.doc_id(d), "title": e.title, "text": " ".join(words)}, mentions


def _per_world(value: int | Mapping[str, int], worlds: Sequence[str], what: str) -> dict[str, int]:
    if isinstance(value, Mapping):
        missing = [w for w in worlds if w not in value]
        if missing:
            raise ValueError(f"{what}: no size for worlds {missing}")
        return {w: int(value[w]) for w in worlds}
    return {w: int(value) for w in worlds}


def zeshel_settings(worlds: Sequence[str] | None = None, entities_per_world: int | Mapping[str, int] = 1000,
                    mentions_per_world: int | Mapping[str, int] = 500, seed: int = 0, *,
                    heldout_seen: float = 0.08, heldout_unseen: float = 0.08, knobs: Knobs = ZESHEL_KNOBS,
                    lexicon_sha256: str) -> dict:
    """Everything the files :func:`write_zeshel` writes depend on, as JSON (``progress``
    changes nothing); recorded as the manifest's ``settings``."""
    worlds = _check_worlds(worlds)
    return json.loads(json.dumps({
        "generator": GENERATOR_VERSION, "seed": seed, "worlds": worlds,
        "entities_per_world": _per_world(entities_per_world, worlds, "entities_per_world"),
        "mentions_per_world": _per_world(mentions_per_world, worlds, "mentions_per_world"),
        "heldout_seen": heldout_seen, "heldout_unseen": heldout_unseen, "knobs": dataclasses.asdict(knobs),
        "lexicon_sha256": lexicon_sha256,
    }))


def zeshel_files(worlds: Sequence[str] | None = None) -> list[str]:
    """The data files :func:`write_zeshel` may write, relative to its directory (a split
    that gets no mention gets no file: an empty split file is an error to kb.prepare)."""
    return [f"documents/{w}.json" for w in _check_worlds(worlds)] + [f"mentions/{s}.json" for s in SPLITS]


def _check_worlds(worlds: Sequence[str] | None) -> list[str]:
    worlds = list(_WORLD_SPLIT) if worlds is None else list(worlds)
    unknown = [w for w in worlds if w not in _WORLD_SPLIT]
    if unknown or not worlds or len(set(worlds)) != len(worlds):
        raise ValueError(f"worlds must be distinct names from {list(_WORLD_SPLIT)}; got {worlds}")
    return worlds


def write_zeshel(
    out_dir: str | os.PathLike,
    worlds: Sequence[str] | None = None,
    entities_per_world: int | Mapping[str, int] = 1000,
    mentions_per_world: int | Mapping[str, int] = 500,
    seed: int = 0,
    *,
    heldout_seen: float = 0.08,
    heldout_unseen: float = 0.08,
    knobs: Knobs = ZESHEL_KNOBS,
    vocab_path: str | os.PathLike | None = None,
    progress: bool | None = None,
) -> Path:
    """Write a synthetic Zeshel tree under ``out_dir``; return ``out_dir``.

    worlds: any subset of the 16 real world names (default all); each goes to its real
      split (train/val/test). Mentions of train worlds are divided between ``train``,
      ``heldout_train_seen`` (fraction ``heldout_seen``) and ``heldout_train_unseen``
      (mentions of a fraction ``heldout_unseen`` of the entities, which never appear as a
      ``train`` label).
    """
    worlds = _check_worlds(worlds)
    docs = _per_world(entities_per_world, worlds, "entities_per_world")
    ments = _per_world(mentions_per_world, worlds, "mentions_per_world")
    lexicon = load_lexicon(vocab_path)
    out = Path(out_dir)
    (out / "documents").mkdir(parents=True, exist_ok=True)
    (out / "mentions").mkdir(parents=True, exist_ok=True)
    show = sum(docs.values()) >= 100_000 if progress is None else progress
    counts: dict = {"worlds": {}, "splits": dict.fromkeys(SPLITS, 0),
                    "categories": {}}
    files: dict = {}
    with contextlib.ExitStack() as stack:
        msinks = {s: JsonlSink(stack, out / "mentions" / f"{s}.json") for s in SPLITS}
        bar = stack.enter_context(tqdm(total=sum(docs.values()), desc="synthetic Zeshel documents",
                                       unit="doc", disable=not show, mininterval=2.0))
        for w in worlds:
            world = _World(seed, w, _WORLD_INDEX[w], docs[w], ments[w], lexicon, knobs)
            serial = 0
            with contextlib.ExitStack() as wstack:
                dsink = JsonlSink(wstack, out / "documents" / f"{w}.json")
                for p in range(docs[w]):
                    doc, mentions = world.document(world.order.inverse(p), heldout_seen, heldout_unseen)
                    dsink.write(doc)
                    for split, m in mentions:
                        m["mention_id"] = world.mention_id(serial)
                        serial += 1
                        msinks[split].write(m)
                        counts["splits"][split] += 1
                        counts["categories"][m["category"]] = counts["categories"].get(m["category"], 0) + 1
                    bar.update(1)
            files[f"documents/{w}.json"] = dsink.summary()
            counts["worlds"][w] = {"split": world.split, "documents": docs[w], "mentions": serial}
    for s, sink in msinks.items():
        if sink.lines:
            files[f"mentions/{s}.json"] = sink.summary()
        else:
            sink.path.unlink()
    settings = zeshel_settings(worlds, docs, ments, seed, heldout_seen=heldout_seen, heldout_unseen=heldout_unseen,
                               knobs=knobs, lexicon_sha256=lexicon.sha256)
    write_manifest(
        out, MANIFEST_KIND, SCHEMA_VERSION, settings=settings, seed=seed, worlds=worlds, entities_per_world=docs,
        mentions_per_world=ments, heldout_seen=heldout_seen, heldout_unseen=heldout_unseen,
        knobs=dataclasses.asdict(knobs), lexicon={"source": lexicon.source, "sha256": lexicon.sha256},
        counts=counts, files=files,
    )
    return out
