"""Records every reader yields, and the bad-record policy they share.

Readers turn each real format (KILT knowledge source, KILT AIDA, Zeshel, BLINK
``entity.jsonl``) into these two shapes, so tokenization and the prepared store never
see format details. Every record remembers ``path:line`` so any later error can name it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class BadRecord(ValueError):
    """A malformed input line; ``str()`` is ``path:line: reason``."""

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = str(path), int(line), reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass
class BadRecordLog:
    """What to do with a malformed line: ``error`` (raise at the first) or ``skip``
    (count it, keep its location and reason for the report and the manifest)."""

    policy: Literal["error", "skip"] = "error"
    skipped: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.policy not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip', got {self.policy!r}")

    def report(self, path: str, line: int, reason: str) -> None:
        if self.policy == "error":
            raise BadRecord(path, line, reason)
        self.skipped.append({"path": str(path), "line": int(line), "reason": reason})

    @property
    def count(self) -> int:
        return len(self.skipped)


@dataclass
class EntityRecord:
    """One KB entity.

    source_id: the source's own id as a string (KILT/BLINK ``wikipedia_id``, Zeshel
      ``document_id``).
    title: entity title.
    description: text after the title (KILT: paragraphs 1.. joined by spaces; Zeshel:
      the document text as the source has it; BLINK: ``text``).
    world: Zeshel world, else None.
    """

    source_id: str
    title: str
    description: str
    world: str | None = None
    path: str = ""
    line: int = 0


@dataclass
class MentionRecord:
    """One mention in context, with its gold reference as the source gives it.

    gold_source_id / gold_title: the gold as written in the source (AIDA: provenance
      ``wikipedia_id`` and ``answer`` title; Zeshel: ``label_document_id``). Both None for
      unlabelled files (``aidayago2-test_without_answers``).
    world: Zeshel world (``corpus``), else None. category: Zeshel ``category``, else None.
    """

    mention_id: str
    left: str
    mention: str
    right: str
    gold_source_id: str | None = None
    gold_title: str | None = None
    world: str | None = None
    category: str | None = None
    path: str = ""
    line: int = 0
