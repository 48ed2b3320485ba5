"""What a user gives the linker, checked and cut into (left, mention, right) records.

Four input forms, all turned into :class:`dist_nce.core.records.MentionRecord` so tokenization is
the training path's own (``dist_nce.core.text.encode_mentions``):

* character spans: ``{"text": "Paris is in France .", "mentions": [[12, 18]]}``;
* KILT entity-linking inputs: ``{"id": ..., "input": "left [START_ENT] m [END_ENT] right"}``,
  cut by the KILT reader's own :func:`kb.kilt.split_marked_input` (one mention per input);
* BLINK's mention lines (its benchmark files, ``AIDA-YAGO2_testb.jsonl`` and the others
  ``scripts/create_BLINK_benchmark_data.py`` writes; its ``--test_mentions``):
  ``{"context_left": ..., "mention": ..., "context_right": ..., "query_id"?: ..., "label_id"?: ...}``,
  one mention per line, id ``query_id`` (else ``id``); BLINK lowercases these texts, which the uncased
  BERT tokenizers do anyway;
* a sentence with the mentions in square brackets (command line, interactive mode):
  ``"Paris is in [France] ."`` -> :func:`parse_brackets` -> the span form.

Left and right contexts and the mention are stripped, as the KILT reader strips them;
the BERT tokenizer splits on whitespace anyway, so the token ids do not depend on it.

Every refusal is a ``ValueError`` whose message starts with ``doc <i>`` and names the field; a
value it quotes is cut to a few dozen characters (:func:`quoted`), and a text holding a lone UTF-16
surrogate (``"\\ud800"`` from a JSON escape: not a character, and no tokenizer takes it) is refused.

A :class:`Mention` keeps a reference to its document's text, not copies of its contexts: a
request of many spans over one long text would otherwise hold spans x text characters. Its
``record`` is cut when asked for (:meth:`dist_nce.link.linker.Linker.prepare` asks a few at a time).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dist_nce.core.records import BadRecord, MentionRecord
from kb.kilt import END_ENT, START_ENT, split_marked_input


@dataclass(frozen=True)
class Mention:
    """One mention to link: where it came from and its record for tokenization.

    doc: index of the document in the request; span: [start, end) characters of the
    document's ``text`` (None for KILT and BLINK inputs); mention: the mention's text, stripped;
    source: the document's ``text`` or KILT ``input`` itself, or BLINK's (context_left, context_right).
    """

    doc: int
    span: tuple[int, int] | None
    mention: str
    mention_id: str
    source: str | tuple[str, str] = field(repr=False, compare=False)

    @property
    def record(self) -> MentionRecord:
        """(left, mention, right) for tokenization; the contexts are copied on each call."""
        if isinstance(self.source, tuple):
            left, right = self.source
            return MentionRecord(mention_id=self.mention_id, left=left.strip(), mention=self.mention,
                                 right=right.strip())
        if self.span is None:
            left, mention, right = split_marked_input(self.source, f"doc {self.doc}", 0)
        else:
            a, b = self.span
            left, mention, right = self.source[:a].strip(), self.mention, self.source[b:].strip()
        return MentionRecord(mention_id=self.mention_id, left=left, mention=mention, right=right)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


BLINK_FIELDS = ("context_left", "mention", "context_right")
_SURROGATE = re.compile("[\ud800-\udfff]")


def quoted(value: Any, chars: int = 60) -> str:
    """``repr(value)`` for a message, cut to ``chars`` characters (a refused value may be megabytes)."""
    text = repr(value[:chars] if isinstance(value, str) else value)
    size = len(value) if isinstance(value, str) else len(text)
    return text if size <= chars and len(text) <= chars else f"{text[:chars]}... ({size} characters)"


def _check_text(where: str, text: str) -> None:
    m = _SURROGATE.search(text)
    if m is not None:
        raise ValueError(f"{where}: lone UTF-16 surrogate \\u{ord(m.group()):04x} at character {m.start()} "
                         "(not a Unicode character)")


def _span_mentions(i: int, doc: Mapping[str, Any]) -> list[Mention]:
    text = doc["text"]
    if not isinstance(text, str):
        raise ValueError(f"doc {i}: field 'text': expected a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"doc {i}: field 'text': empty text")
    _check_text(f"doc {i}: field 'text'", text)
    if "mentions" not in doc:
        raise ValueError(f"doc {i}: field 'mentions': missing (give [[start, end], ...] character spans "
                         f"of 'text')")
    spans = doc["mentions"]
    if not isinstance(spans, (list, tuple)) or not spans:
        raise ValueError(f"doc {i}: field 'mentions': expected a non-empty list of [start, end] spans, "
                         f"got {quoted(spans)}")
    out = []
    for j, span in enumerate(spans):
        where = f"doc {i}: field 'mentions[{j}]'"
        if not isinstance(span, (list, tuple)) or len(span) != 2 or not all(_is_int(x) for x in span):
            raise ValueError(f"{where}: expected [start, end] integers, got {quoted(span)}")
        a, b = span
        if not 0 <= a < b <= len(text):
            raise ValueError(f"{where}: span [{a}, {b}) is outside the text (length {len(text)}) or empty")
        mention = text[a:b].strip()
        if not mention:
            raise ValueError(f"{where}: span [{a}, {b}) holds only whitespace")
        out.append(Mention(i, (a, b), mention, f"{i}:{j}", text))
    return out


def _kilt_mention(i: int, doc: Mapping[str, Any]) -> Mention:
    text = doc["input"]
    if not isinstance(text, str):
        raise ValueError(f"doc {i}: field 'input': expected a string, got {type(text).__name__}")
    _check_text(f"doc {i}: field 'input'", text)
    try:
        _, mention, _ = split_marked_input(text, f"doc {i}", 0)
    except BadRecord as e:
        raise ValueError(f"doc {i}: {e.reason}") from None
    if not mention:
        raise ValueError(f"doc {i}: field 'input': empty mention between {START_ENT} and {END_ENT}")
    return Mention(i, None, mention, str(doc.get("id", i)), text)


def _blink_mention(i: int, doc: Mapping[str, Any]) -> Mention:
    texts = []
    for key in BLINK_FIELDS:
        if key not in doc:
            raise ValueError(f"doc {i}: field '{key}': missing (a BLINK mention line has "
                             f"{', '.join(BLINK_FIELDS)})")
        if not isinstance(doc[key], str):
            raise ValueError(f"doc {i}: field '{key}': expected a string, got {type(doc[key]).__name__}")
        _check_text(f"doc {i}: field '{key}'", doc[key])
        texts.append(doc[key])
    left, mention, right = texts
    if not mention.strip():
        raise ValueError(f"doc {i}: field 'mention': empty mention")
    return Mention(i, None, mention.strip(), str(doc.get("query_id", doc.get("id", i))), (left, right))


def parse_docs(docs: Sequence[Mapping[str, Any]]) -> list[Mention]:
    """Every mention of ``docs`` in order (doc by doc, span by span); ValueError on the first bad one."""
    if isinstance(docs, (str, bytes)) or not isinstance(docs, Sequence):
        raise ValueError(f"expected a list of documents, got {type(docs).__name__}")
    if not docs:
        raise ValueError("no documents to link")
    mentions: list[Mention] = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, Mapping):
            raise ValueError(f"doc {i}: expected an object with 'text' and 'mentions' (or a KILT 'input', or "
                             f"BLINK's 'mention' with its contexts), got {type(doc).__name__}")
        forms = [name for name, key in (("'text' + 'mentions'", "text"), ("a KILT 'input'", "input"),
                                        ("BLINK's 'mention'", "mention")) if key in doc]
        if len(forms) > 1:
            raise ValueError(f"doc {i}: give one of {', '.join(forms)}, not several")
        if "text" in doc:
            mentions.extend(_span_mentions(i, doc))
        elif "input" in doc:
            mentions.append(_kilt_mention(i, doc))
        elif "mention" in doc:
            mentions.append(_blink_mention(i, doc))
        else:
            raise ValueError(f"doc {i}: field 'text': missing (give 'text' + 'mentions', a KILT 'input' "
                             f"with {START_ENT} ... {END_ENT}, or BLINK's {', '.join(BLINK_FIELDS)})")
    return mentions


def parse_brackets(line: str) -> dict[str, Any]:
    """``"Paris is in [France] ."`` -> ``{"text": "Paris is in France .", "mentions": [[12, 18]]}``.

    A line with KILT markers is passed on as ``{"input": line}``. Brackets cannot nest;
    a line without a bracketed mention, or with an unbalanced bracket, is refused.
    """
    if START_ENT in line or END_ENT in line:
        return {"input": line}
    text: list[str] = []
    spans: list[list[int]] = []
    start = None
    pos = 0
    for c in line:
        if c == "[":
            if start is not None:
                raise ValueError(f"nested '[': {line!r}")
            start = pos
        elif c == "]":
            if start is None:
                raise ValueError(f"']' without '[': {line!r}")
            spans.append([start, pos])
            start = None
        else:
            text.append(c)
            pos += 1
    if start is not None:
        raise ValueError(f"'[' without ']': {line!r}")
    if not spans:
        raise ValueError(f"mark at least one mention with [brackets] (or {START_ENT} ... {END_ENT}): {line!r}")
    return {"text": "".join(text), "mentions": spans}
