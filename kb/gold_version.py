"""Mention golds at a KB version: which prepared ``gold_row`` values still hold after deltas.

Mention tables are written once, by ``kb.prepare``, against KB version 0; deltas
(``kb.delta``) never rewrite them. A reader at KB version v applies one rule
(docs/design.md section 6, "Keeping the KB current"):

* a prepared gold row that is live at v stays;
* a prepared gold row removed at v is looked up again by the removed entity's own source
  id: a replaced entity (remove + add of the same id) carries its mentions to its new
  row; an entity removed for good leaves them unresolvable (``gold_row`` -1, status
  ``removed``), counted, never silently dropped;
* a gold that was ``missing`` when prepared is looked up by its source id at v, so an
  entity added later resolves it (status ``id``). Titles are not searched again.

Version 0 returns the prepared columns unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# How each mention's gold was resolved (the mention table's gold_status column).
GOLD_BY_ID = "id"  # gold source id found in the KB
GOLD_BY_TITLE = "title"  # id absent, gold title found (AIDA titles that KILT renamed keep their id)
GOLD_MISSING = "missing"  # labelled, but the gold entity is not in the KB: gold_row == -1
GOLD_UNLABELLED = "unlabelled"  # the source has no gold (aidayago2-test_without_answers): gold_row == -1
GOLD_REMOVED = "removed"  # resolved when prepared, but the entity is removed at the KB version read: -1


def gold_at_version(store: Any, gold_rows: np.ndarray, status: Sequence[str],
                    gold_source_ids: Sequence[str | None]) -> tuple[np.ndarray, list[str]]:
    """(rows [N] int64, status [N]) of prepared golds at ``store``'s KB version (module docstring).

    store: an ``EntityStore`` opened at the version (whole, not a slice); gold_rows [N] int64 and
    status/gold_source_ids [N] as prepared.
    """
    rows = np.asarray(gold_rows, dtype=np.int64).copy()
    status = list(status)
    if store.kb_version == 0 or not len(rows):
        return rows, status
    had = rows >= 0
    dead = np.zeros(len(rows), dtype=bool)
    dead[had] = ~store.is_live(rows[had])
    dead_idx = np.flatnonzero(dead)
    missing_idx = np.array([i for i, s in enumerate(status) if s == GOLD_MISSING and gold_source_ids[i] is not None],
                           dtype=np.int64)
    keys = list(store.source_ids(rows[dead_idx])) if len(dead_idx) else []
    keys += [gold_source_ids[i] for i in missing_idx]
    found = store.rows_for_source_ids(keys) if keys else np.zeros(0, np.int64)
    for i, row in zip(dead_idx, found[:len(dead_idx)]):
        rows[i] = row
        if row < 0:
            status[i] = GOLD_REMOVED
    for i, row in zip(missing_idx, found[len(dead_idx):]):
        if row >= 0:
            rows[i], status[i] = row, GOLD_BY_ID
    return rows, status


def gold_changes(before: tuple[np.ndarray, list[str]], after: tuple[np.ndarray, list[str]]) -> dict:
    """Counts for a delta's record: golds that became unresolvable, moved to a new row, or resolved."""
    (r0, s0), (r1, s1) = before, after
    return {
        "unresolvable": int(((r0 >= 0) & (r1 < 0)).sum()),
        "moved": int(((r0 >= 0) & (r1 >= 0) & (r0 != r1)).sum()),
        "resolved": int(((r0 < 0) & (r1 >= 0)).sum()),
        "removed_total": sum(s == GOLD_REMOVED for s in s1),
        "resolved_total": int((r1 >= 0).sum()),
    }
