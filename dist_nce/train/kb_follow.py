"""A training worker across KB deltas: follow the KB version its negatives come from.

The driver applies a delta to the running service (``dist_nce.train.kb_control``); a worker
learns of it from the first answer of a newer index version and then (:meth:`KbFollower.follow`)
re-reads the service's live rows (``NegativeService.sync_kb``: random negatives from then on are
drawn over the new live rows), reopens the store at the new KB version (new rows can be
negatives) and re-reads the training golds at that version (``kb.gold_version``: a removed
gold reads -1, a replaced one its new row).

A mention is trained on only if the gold it was mined with is still its gold and live at the
KB version followed (:meth:`KbFollower.keep`): a gold removed mid-run, or replaced (whose new
row the sampler did not exclude), is skipped in that batch and counted, never crashed on.
Mentions whose gold is unresolvable when the run starts are excluded by the plan, as before.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dist_nce.actors.protocols import NegativeSource


class KbFollower:
    """service: the worker's NegativeService copy; prepared_dir/split: the training data."""

    def __init__(self, service: NegativeSource, prepared_dir: str, split: str):
        from kb.store import EntityStore, MentionTable

        self.service, self.prepared_dir, self.split = service, prepared_dir, split
        self.kb_version = int(getattr(service, "kb_version", 0))  # what the service's shards serve
        self.store = EntityStore(prepared_dir, kb_version=self.kb_version)
        table = MentionTable(prepared_dir, split, kb_version=self.kb_version)
        self.prepared = table.prepared_gold_rows
        self._set_gold(table.gold_rows)
        self._seen = -1
        self.skipped = 0

    def follow(self, version: int | None = None) -> bool:
        """After an answer from index ``version`` (None: ask now): on a newer index version, follow the
        KB version the shards serve. True when the KB version changed (store and golds were re-read)."""
        if not hasattr(self.service, "sync_kb") or (version is not None and version <= self._seen):
            return False
        if version is not None:
            self._seen = int(version)
        return self._open(int(self.service.sync_kb()))

    def _open(self, kb_version: int) -> bool:
        """Read the store and the golds at ``kb_version`` (the one the service copy now follows); True when it
        changed."""
        if kb_version == self.kb_version:
            return False
        from kb.store import EntityStore, MentionTable

        self.store = EntityStore(self.prepared_dir, kb_version=kb_version)
        self._set_gold(MentionTable(self.prepared_dir, self.split, kb_version=kb_version).gold_rows)
        self.kb_version = kb_version
        return True

    @property
    def seen(self) -> int:
        """The newest index version an answer came from (-1: none yet); with :attr:`kb_version`, what a
        checkpoint records for :meth:`resume`."""
        return self._seen

    def follow_served(self) -> bool:
        """At a fresh worker's start: follow the KB version the shards serve, and count their index version as
        seen (an answer from it or an older one asks nothing new; a delta served later is followed from its
        first answer). A resumed worker whose checkpoint recorded what it followed uses :meth:`resume`."""
        self._seen = max(self._seen, int(self.service.version()))
        return self.follow(None)

    def resume(self, kb_version: int, seen: int) -> bool:
        """At a resumed worker's start: follow the KB version this rank followed at its checkpoint, and the
        index version it had seen. A delta the shards served before the checkpoint but whose negatives no step
        had used yet is then followed at the step that first uses them, as the uninterrupted run did (its
        random negatives drawn over the older KB's live rows until then, its golds read at that KB), where
        :meth:`follow_served` followed it from the rerun's first step. True when the KB version changed."""
        self._seen = int(seen)
        if not hasattr(self.service, "sync_kb"):
            return False
        return self._open(int(self.service.sync_kb(int(kb_version))))

    def store_kb_version(self) -> int:
        """The KB version the store is at on disk now (``jobs/update_kb.py`` may have moved it past the one
        followed)."""
        from kb.store import EntityStore

        return int(EntityStore(self.prepared_dir).kb_version)

    def _set_gold(self, gold: np.ndarray) -> None:
        """``gold``: [N] the golds at the KB version followed (-1: removed); ``mining_gold``: [N] the rows a
        request excludes, the gold or, where a delta removed it, the prepared row (removed rows are excluded
        anyway, and :meth:`keep` skips such a mention)."""
        self.gold = gold
        self.mining_gold = np.where(gold >= 0, gold, self.prepared)

    def keep(self, mentions: np.ndarray, mined_gold: Tensor) -> Tensor:
        """bool [b]: the gold each mention was mined with [b] is still its live gold at the followed KB
        version (so the sampler excluded it)."""
        now = torch.from_numpy(np.asarray(self.gold[mentions], dtype=np.int64))
        return (now == mined_gold.cpu()) & (now >= 0)
