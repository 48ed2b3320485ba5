"""Inputs that parse but cannot be what the user meant: empty sources, mostly unresolved gold.

An entity file or a mention split with no records gives a store that looks fine and
trains on nothing (every gold "missing", zero mentions), so it stops the prepare with
an error naming the file unless ``--allow-empty``. A split whose labelled mentions
mostly miss their gold entity (a KB from another dump, the wrong worlds) is prepared
but warned about loudly, with the counts, and the rate is recorded in the manifest.
"""
from __future__ import annotations

from typing import Callable, Iterable

from kb.store import GOLD_BY_ID, GOLD_BY_TITLE, GOLD_MISSING


class EmptyInput(ValueError):
    """A source file that holds no records."""


def check_not_empty(entity_rows: Iterable[tuple[str, int]], mention_rows: Iterable[tuple[str, str, int]],
                    allow_empty: bool, log: Callable[[str], None]) -> list[str]:
    """``entity_rows``: (file, records read); ``mention_rows``: (split, file, records read).
    Raise :class:`EmptyInput` naming every empty one or, with ``allow_empty``, log them
    and return them (for the manifest's warnings)."""
    empty = [f"{path}: no entities (an empty file, or only blank or skipped lines)"
             for path, rows in entity_rows if rows == 0]
    empty += [f"{path}: no mentions in split {split!r} (an empty file, or only blank or skipped lines)"
              for split, path, rows in mention_rows if rows == 0]
    if empty and not allow_empty:
        raise EmptyInput("\n".join(empty) + "\n(pass --allow-empty to prepare the store anyway)")
    for line in empty:
        log(f"WARNING: {line}; prepared anyway (--allow-empty)")
    return empty


def gold_resolution(gold: dict[str, int], threshold: float) -> dict:
    """The manifest's record of how many labelled mentions found their gold entity."""
    resolved = gold[GOLD_BY_ID] + gold[GOLD_BY_TITLE]
    labelled = resolved + gold[GOLD_MISSING]
    rate = round(resolved / labelled, 4) if labelled else None
    return {"labelled": labelled, "resolved": resolved, "rate": rate, "threshold": threshold,
            "below_threshold": rate is not None and rate < threshold}


def resolution_warning(split: str, source: str, res: dict) -> str | None:
    """The loud message for a split below the threshold, or None."""
    if not res["below_threshold"]:
        return None
    return (f"mentions {split} ({source}): gold entity found for only {res['resolved']:,} of {res['labelled']:,} "
            f"labelled mentions ({100 * res['rate']:.1f}% < {100 * res['threshold']:.0f}%); "
            f"{res['labelled'] - res['resolved']:,} are kept with gold_row -1. Is the KB the one these mentions "
            "link into (same dump, same worlds)?")


def ambiguity_warning(split: str, source: str, ambiguous: dict) -> str | None:
    """The message for golds resolved by a title that several entities share, or None."""
    if not ambiguous["count"]:
        return None
    ids = ambiguous["mention_ids"]
    return (f"mentions {split} ({source}): {ambiguous['count']:,} gold(s) found only by a title that several "
            f"entities share were resolved to the first of them (mention ids {', '.join(ids[:5])}"
            f"{' ...' if ambiguous['count'] > 5 else ''}; all in manifest.json, ambiguous_title); give them "
            "wikipedia_ids to pick the entity")
