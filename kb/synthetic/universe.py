"""The entity universe behind both synthetic generators.

Every fact about entity ``i`` (its name group, topic, title, signature words, text) is
a pure function of ``(seed, salt, i)`` computed on demand, so a writer streams any
number of entities in constant memory and a mention can look up its gold's name and
words without anything being stored. See :mod:`kb.synthetic` for the generative story.
"""
from __future__ import annotations

import functools
import math
import random
import zlib
from dataclasses import dataclass
from typing import Sequence

from kb.synthetic.lexicon import (
    FUNCTION_WORDS, WORD2, WORD3, Domain, Lexicon, accent, one_word_name, two_word_name,
)

_M64 = (1 << 64) - 1
_TWO53 = float(1 << 53)
# Bump whenever the same settings would generate different files (a new word, a new
# knob default, a changed draw): directories made by another generator are regenerated
# instead of reused (kb.synthetic.cache).
GENERATOR_VERSION = 2  # 2: a split with no mentions gets no (empty) file
BLOCK = 8  # name groups never straddle a block, so a group is found in O(BLOCK)
_ROMAN = ("", " II", " III", " IV", " V", " VI", " VII", " VIII")

# Hash tags: one per kind of draw, so draws of different kinds are independent.
(T_GROUP, T_TOPIC, T_SIB, T_YEAR, T_NAME, T_ENT, T_DRIFT, T_TOPICWORDS, T_MENTION,
 T_PERM, T_WID, T_LINK, T_SPLIT, T_DOC) = range(1, 15)


def mix64(x: int) -> int:
    """splitmix64 finalizer: a bijection on 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash64(*parts: int) -> int:
    """Counter-based hash of a tuple of integers (order-sensitive)."""
    return _chain(0x243F6A8885A308D3, parts)


def _chain(x: int, parts: tuple[int, ...]) -> int:
    # mix64 inlined: this is the generators' innermost loop.
    for p in parts:
        x = ((x ^ (p & _M64)) + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    return x


def unit(h: int) -> float:
    """A 64-bit hash as a float uniform in [0, 1)."""
    return (h >> 11) / _TWO53


class AffinePermutation:
    """``i -> (a*i + c) % n`` with gcd(a, n) == 1: a seeded permutation of ``range(n)``
    with an O(1) inverse, so a writer can emit line ``p`` without a table."""

    def __init__(self, h: int, n: int):
        a = (h % n) or 1
        while math.gcd(a, n) != 1:
            a += 1
        self.n, self.a, self.c = n, a, mix64(h) % n
        self._a_inv = pow(a, -1, n) if n > 1 else 0

    def __call__(self, i: int) -> int:
        return (self.a * i + self.c) % self.n

    def inverse(self, p: int) -> int:
        return ((p - self.c) * self._a_inv) % self.n


def salt_int(salt: str) -> int:
    return zlib.crc32(salt.encode("utf-8"))


@dataclass(frozen=True)
class Knobs:
    """How the universe and its texts are drawn (defaults aim at a task a small BERT
    learns in minutes: name matching alone is ambiguous, context resolves most cases)."""

    num_topics: int | None = None       # None: num_entities // 40, clipped to [2*domains, 20000]
    topic_words: int = 24               # words per topic vocabulary
    signature_words: int = 4            # entity-specific words in its description
    signature_keep: float = 0.6         # chance each signature word shows up in a context
    group_sizes: tuple[float, ...] = (0.40, 0.30, 0.18, 0.12)  # P(name shared by 1, 2, 3, 4 entities)
    sibling_same_topic: float = 0.15    # a same-name sibling also shares the topic (only signatures differ)
    sibling_same_domain: float = 0.25   # ... or shares the domain ("(footballer, born 1962)")
    two_word_names: float = 0.6         # "First Last" vs a single-word name
    accented_names: float = 0.03        # names with one diacritic
    context_words: tuple[int, int] = (20, 60)  # words on each side of a mention
    description_words: tuple[int, int] = (40, 90)
    ambiguous_bias: float = 0.5         # redraw a gold whose name is unique with this probability
    partial_name: float = 0.10          # mention is one word of a two-word name
    alias: float = 0.03                 # mention is the entity's alias
    edge: float = 0.05                  # mention at the very start (or end) of its context

    def validate(self) -> None:
        lo, hi = self.context_words
        if not 0 <= lo <= hi:
            raise ValueError(f"context_words must be 0 <= min <= max, got {self.context_words}")
        lo, hi = self.description_words
        if not 1 <= lo <= hi:
            raise ValueError(f"description_words must be 1 <= min <= max, got {self.description_words}")
        if not self.group_sizes or len(self.group_sizes) > BLOCK or abs(sum(self.group_sizes) - 1) > 1e-6:
            raise ValueError(f"group_sizes must be 1..{BLOCK} probabilities summing to 1, got {self.group_sizes}")
        if self.signature_words < 1 or self.topic_words < 1:
            raise ValueError("signature_words and topic_words must be >= 1")
        for name in ("signature_keep", "sibling_same_topic", "sibling_same_domain", "two_word_names",
                     "accented_names", "ambiguous_bias", "partial_name", "alias", "edge"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability, got {getattr(self, name)}")


@dataclass(frozen=True)
class Entity:
    index: int
    name: str                 # the surface name shared by the group ("Branel Tovasth")
    title: str                # unique title ("Branel Tovasth (footballer)")
    old_title: str            # an outdated title that names no current entity
    primary: bool             # title == name
    topic: int
    domain: Domain
    year: int
    signature: tuple[str, ...]
    alias: str


class Universe:
    """Entities ``[0, num_entities)`` plus "phantoms" ``>= num_entities`` (entities that
    exist in the story but not in the written KB: golds missing from the KB)."""

    def __init__(self, seed: int, num_entities: int, domains: Sequence[Domain], lexicon: Lexicon,
                 knobs: Knobs, salt: str = "", extra_words: Sequence[str] = ()):
        knobs.validate()
        if num_entities < 1:
            raise ValueError(f"num_entities must be >= 1, got {num_entities}")
        self.n = num_entities
        self.domains = tuple(domains)
        self.lex = lexicon
        self.k = knobs
        self.base = hash64(seed, salt_int(salt))
        self.extra_words = tuple(extra_words)
        nd = len(self.domains)
        t = knobs.num_topics if knobs.num_topics is not None else min(max(num_entities // 40, 2 * nd), 20000)
        self.num_topics = max(t, nd)  # domain_of(topic) = topic % nd needs a topic per domain
        cum, acc = [], 0.0
        for p in knobs.group_sizes:
            acc += p
            cum.append(acc)
        self._size_cdf = tuple(cum)
        # Affine bijections that scatter group ids over the name spaces.
        self._name2 = (1_000_003, hash64(self.base, T_NAME, 2) % (WORD2 * WORD2))
        self._name1 = (7_919_993, hash64(self.base, T_NAME, 1) % WORD3)
        # Small bounded caches: drawing one page or mention asks for the same block and
        # group several times; topics recur across the whole KB.
        self.topic_words = functools.lru_cache(maxsize=4096)(self._topic_words)
        self._block_cached = functools.lru_cache(maxsize=64)(self._block)
        self.group_titles = functools.lru_cache(maxsize=64)(self._group_titles)

    # ---- cheap per-index facts (a few hash calls each) ---------------------------------
    def h(self, *parts: int) -> int:
        return _chain(self.base, parts)

    def _block(self, b: int) -> tuple[int, ...]:
        """Group boundaries in block ``b``: starts, then the block end."""
        s, end, bounds = b * BLOCK, (b + 1) * BLOCK, []
        while s < end:
            bounds.append(s)
            u = unit(self.h(T_GROUP, s))
            s = min(s + next((k + 1 for k, c in enumerate(self._size_cdf) if u < c), len(self._size_cdf)), end)
        bounds.append(end)
        return tuple(bounds)

    def group(self, i: int) -> tuple[int, int]:
        """(start, size) of the name group of ``i``; groups never mix real and phantom."""
        bounds = self._block_cached(i // BLOCK)
        k = 1
        while bounds[k] <= i:
            k += 1
        s, e = bounds[k - 1], bounds[k]
        if s < self.n < e:
            s, e = (s, self.n) if i < self.n else (self.n, e)
        return s, e - s

    def name(self, start: int) -> str:
        """The group's surface name; injective in ``start``."""
        h = self.h(T_NAME, start)
        if unit(h) < self.k.two_word_names:
            a, b = self._name2
            nm = two_word_name((a * start + b) % (WORD2 * WORD2))
        else:
            a, b = self._name1
            nm = one_word_name((a * start + b) % WORD3)
        if unit(mix64(h)) < self.k.accented_names:
            nm = accent(nm, h)
        return nm

    def topic(self, i: int, start: int | None = None) -> int:
        """Topic of ``i``; a non-primary sibling may copy the primary's topic or domain."""
        if start is None:
            start = self.group(i)[0]
        u = unit(self.h(T_SIB, i))
        if i != start and u < self.k.sibling_same_topic:
            return self._own_topic(start)
        if i != start and u < self.k.sibling_same_topic + self.k.sibling_same_domain:
            nd = len(self.domains)
            d = self._own_topic(start) % nd
            return d + nd * (self.h(T_TOPIC, i, 1) % (self.num_topics // nd))
        return self._own_topic(i)

    def _own_topic(self, i: int) -> int:
        return self.h(T_TOPIC, i) % self.num_topics

    def domain(self, topic: int) -> Domain:
        return self.domains[topic % len(self.domains)]

    def year(self, i: int) -> int:
        return 1900 + self.h(T_YEAR, i) % 110

    def _topic_words(self, topic: int) -> tuple[str, ...]:
        rng = random.Random(self.h(T_TOPICWORDS, topic))
        return tuple(rng.sample(self.lex.content, self.k.topic_words))

    def _group_titles(self, start: int, size: int) -> tuple[tuple[str, str], ...]:
        """(title, old_title) for each member; member 0 is the primary topic (bare name).

        Qualifiers follow Wikipedia: the domain alone when it is unique among the
        siblings, else "born YEAR" / "YEAR film" / a Roman numeral, all unique.
        """
        name = self.name(start)
        doms = [self.domain(self.topic(m, start)) for m in range(start, start + size)]
        years = [self.year(m) for m in range(start, start + size)]
        out = [(name, self._old_primary(name, doms[0]))]
        seen_years: dict[str, set[int]] = {}
        rank: dict[str, int] = {}
        for j in range(1, size):
            d = doms[j]
            shared = sum(1 for x in doms[1:] if x is d) > 1
            rank[d.qualifier] = rank.get(d.qualifier, 0) + 1
            if not shared:
                qual = old = ""
            elif d.style == "plain":
                qual = old = _ROMAN[rank[d.qualifier] - 1]
            else:
                y = years[j]
                used = seen_years.setdefault(d.qualifier, set())
                while y in used:
                    y += 1
                used.add(y)
                qual = old = f", born {y}" if d.style == "person" else str(y)
            if d.style == "work" and qual:
                out.append((f"{name} ({qual} {d.qualifier})", f"{name} ({old} {d.old_qualifier})"))
            else:
                out.append((f"{name} ({d.qualifier}{qual})", f"{name} ({d.old_qualifier}{old})"))
        return tuple(out)

    @staticmethod
    def _old_primary(name: str, d: Domain) -> str:
        first, _, last = name.partition(" ")
        if last:  # "Branel K. Tovasth": a middle initial no generated name has
            return f"{first} {chr(ord('A') + len(last) % 26)}. {last}"
        return f"{name} ({d.old_qualifier})"

    def entity(self, i: int) -> Entity:
        start, size = self.group(i)
        title, old = self.group_titles(start, size)[i - start]
        topic = self.topic(i, start)
        rng = random.Random(self.h(T_ENT, i))
        sig = tuple(rng.sample(self.lex.content, self.k.signature_words))
        return Entity(i, self.name(start), title, old, i == start, topic, self.domain(topic),
                      self.year(i), sig, sig[0].capitalize())

    def drifted(self, i: int, rate: float) -> bool:
        return unit(self.h(T_DRIFT, i)) < rate

    # ---- text ---------------------------------------------------------------------------
    def _bag(self, e: Entity, rng: random.Random) -> list[str]:
        """Word pool for text about ``e``: about half function words, then its topic and
        domain words, words of a random other topic, and general noise."""
        other = self.topic_words(rng.randrange(self.num_topics))
        return [*FUNCTION_WORDS, *self.topic_words(e.topic), *e.domain.words, *self.extra_words,
                *other[:6], *rng.choices(self.lex.content, k=10)]

    def description(self, e: Entity, rng: random.Random, links: Sequence[str] = ()) -> list[list[str]]:
        """Paragraphs of tokens; the first introduces ``e`` and holds every signature word.
        ``links`` are names of other entities woven into the second paragraph."""
        lo, hi = self.k.description_words
        n = rng.randint(lo, hi)
        bag = self._bag(e, rng)
        what = e.domain.qualifier.split()
        if e.domain.style == "work":
            what = [str(e.year), *what]
        article = "an" if what[0][0] in "aeiou" else "a"
        intro = [*e.name.split(), "is", article, *what, ",", "also", "known", "as", e.alias, "."]
        first = rng.choices(bag, k=max(n // 2, len(e.signature) + 2))
        for w in e.signature:
            first.insert(rng.randrange(len(first) + 1), w)
        second = rng.choices(bag, k=n - n // 2)
        for name in links:
            second.insert(rng.randrange(len(second) + 1), name)
        return [intro + _sentences(first, rng), _sentences(second, rng)]

    def context(self, e: Entity, rng: random.Random, side: str) -> list[str]:
        """Tokens on one ``side`` ("left"/"right") of a mention of ``e``: topic words
        throughout and each signature word with probability ``signature_keep``, placed
        near the mention (noisy: a reader must look for them)."""
        lo, hi = self.k.context_words
        n = rng.randint(lo, hi)
        if n == 0:
            return []
        toks = rng.choices(self._bag(e, rng), k=n)
        near = min(n, 15)
        for w in e.signature:
            if rng.random() < self.k.signature_keep:
                pos = rng.randrange(near + 1)
                toks.insert(len(toks) - pos if side == "left" else pos, w)
        if rng.random() < 0.3:  # another entity's name in passing
            other = self.name(self.group(rng.randrange(self.n))[0])
            toks.insert(rng.randrange(len(toks) + 1), other)
        toks = _sentences(toks, rng, capitalize_first=side == "left")
        if side == "left":
            toks.pop()  # the mention continues the last sentence
        return toks

    def surface(self, e: Entity, rng: random.Random, partial: float, alias: float) -> str:
        """The mention string: the bare name, one of its words, or the alias."""
        u = rng.random()
        parts = e.name.split()
        if u < alias:
            return e.alias
        if u < alias + partial and len(parts) > 1:
            return parts[rng.randrange(len(parts))]
        return e.name

    def pick_gold(self, rng: random.Random) -> int:
        """A real entity, redrawn once with probability ``ambiguous_bias`` when its name
        is unique (so most mentions need disambiguation)."""
        g = rng.randrange(self.n)
        if self.group(g)[1] == 1 and rng.random() < self.k.ambiguous_bias:
            g = rng.randrange(self.n)
        return g


def _sentences(tokens: list[str], rng: random.Random, capitalize_first: bool = True) -> list[str]:
    """Cut a token list into capitalised sentences of 8-18 tokens, about half with a
    comma; punctuation is a separate token (CoNLL/Zeshel style; KILT paragraphs
    re-attach it)."""
    out: list[str] = []
    i, n, first = 0, len(tokens), capitalize_first
    while i < n:
        k = 8 + int(rng.random() * 11)
        sent = tokens[i:i + k]
        if first and sent[0].islower():
            sent[0] = sent[0].capitalize()
        if len(sent) > 4 and rng.random() < 0.5:
            sent.insert(2 + int(rng.random() * (len(sent) - 3)), ",")
        out += sent
        out.append(".")
        i += k
        first = True
    return out


def detokenize(tokens: Sequence[str]) -> str:
    """Tokens -> prose: "," and "." attach to the previous word."""
    return " ".join(tokens).replace(" ,", ",").replace(" .", ".")
