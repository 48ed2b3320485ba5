"""Synthetic KILT / AIDA / BLINK / Zeshel data in the real file formats, at any size.

Generative story (what makes hard negatives matter)
---------------------------------------------------
* **Topics.** Entities fall into topics. A topic belongs to a domain (KILT:
  footballer, politician, film, ...; Zeshel: the world's entity kinds) and has a
  vocabulary of ``topic_words`` real English words (word-pieces of the uncased BERT
  vocab) plus its domain's words.
* **Shared names.** Entities come in name groups of 1-4 (``group_sizes``) sharing one
  surface name. The first member is the primary topic and is titled with the bare name;
  the others get Wikipedia-style qualifiers: "Branel Tovasth (footballer)", "(politician,
  born 1962)", "(1962 film)", "(character II)". Siblings usually differ in topic, but a
  fraction share the domain (``sibling_same_domain``) or even the topic
  (``sibling_same_topic``), where only signature words tell them apart.
* **Descriptions** introduce the entity ("X is a footballer, also known as Alias, ...")
  and mix function words, topic and domain words, noise, and every one of the entity's
  ``signature_words`` (entity-specific words) in the first paragraph.
* **Mentions** use the bare shared name (sometimes one word of it, or the alias) in
  a context of ``context_words`` words per side drawn from the gold's topic vocabulary
  plus noise, where each signature word appears with probability ``signature_keep``.

So the name narrows the KB to a group but cannot pick within it (string matching is
right about once per group size), while the context identifies the gold's topic and
usually its signature: a retriever trained with random negatives learns names, one
trained with hard (same-name, same-topic) negatives learns to read the context.

Every fact about entity ``i`` is a pure function of ``(seed, i)``, so writers stream
millions of entities in constant memory and the same seed gives byte-identical data
files (``manifest.json`` also records its creation time).

Realism knobs: AIDA gold titles that are outdated (``title_drift``: resolvable only via
``wikipedia_id``), golds absent from the KB (``missing_gold``), mentions at the very
start or end of their context (``edge``), KILT lines without ``wikidata_info``, Section
lines, anchors, and names with diacritics.

Command line::

    python -m kb.synthetic kilt --out DIR --entities 5000 --train 2000 --dev 500 --test 500 --seed 0 --blink
    python -m kb.synthetic zeshel --out DIR --entities-per-world 1000 --mentions-per-world 500 \\
        --worlds starwars muppets lego --seed 0
"""
from kb.synthetic.kilt import AIDA_FILES, BLINK_FILE, KB_FILE, KiltUniverse, write_kilt
from kb.synthetic.universe import Knobs
from kb.synthetic.zeshel import SPLITS, ZESHEL_KNOBS, write_zeshel, zeshel_category

__all__ = [
    "AIDA_FILES", "BLINK_FILE", "KB_FILE", "KiltUniverse", "Knobs", "SPLITS", "ZESHEL_KNOBS",
    "write_kilt", "write_zeshel", "zeshel_category",
]
