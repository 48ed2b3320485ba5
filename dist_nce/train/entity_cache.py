"""Candidate reps of a frozen entity tower, encoded once per KB version (``model.entity_cache``).

With ``model.freeze_entity_encoder`` the entity tower never changes, so re-encoding the B x K
candidates of every step repeats the same forward passes: at K = 16 that is 16 times the mention
side's tokens, most of a CPU step with MiniLM. The cache encodes the worker's entity store once and
a step gathers its candidates' rows.

The reps are taken in eval mode. A frozen tower that re-encodes its candidates inside the training
step runs in train mode, so it adds dropout noise to every candidate; the cached reps are the ones
the shards index and the evaluation scores (ELQ's precomputed KB works the same way).
"""
from __future__ import annotations

import numpy as np
import torch

from dist_nce.index.encode import encode_rows
from dist_nce.modeling.retriever import EntityEncoder
from dist_nce.modeling.scoring import Reps


def gather_reps(reps: Reps, rows: torch.Tensor) -> Reps:
    """Rows of a rep table.

    Args:
        reps: vecs [N, ...] (mask [N, n] or None).
        rows: [B, K] int64 row ids into the table.

    Returns:
        Reps with vecs [B, K, ...] (mask [B, K, n] or None), on the table's device.
    """
    rows = rows.to(reps.vecs.device)
    return Reps(reps.vecs[rows], None if reps.mask is None else reps.mask[rows])


class FrozenEntityCache:
    """The entity reps of one store, rebuilt when the worker follows a new KB version (a new store)."""

    def __init__(self, side: EntityEncoder, batch_size: int, device: torch.device | str):
        self.side, self.batch_size, self.device = side, batch_size, torch.device(device)
        self._store = None
        self._reps: Reps | None = None
        self.encodes = 0  # how many times a store was encoded (a new KB version each)

    def table(self, store) -> Reps:
        """Reps of every row of ``store`` (an ``EntityStore``): vecs [N, ...] fp32 on the device."""
        if store is not self._store:
            was_training = self.side.training
            self.side.eval()
            try:
                # bf16 engines hold bf16 weights: encode_rows then needs no autocast (its docstring)
                reps = encode_rows(self.side, store, self.batch_size, self.device, None, "float32")
            finally:
                self.side.train(was_training)
            self._reps = Reps(reps.vecs.to(self.device), None if reps.mask is None else reps.mask.to(self.device))
            self._store = store
            self.encodes += 1
        assert self._reps is not None
        return self._reps

    def candidates(self, store, rows: torch.Tensor | np.ndarray) -> Reps:
        """rows [B, K] (global store rows) -> Reps vecs [B, K, ...] of those candidates."""
        return gather_reps(self.table(store), torch.as_tensor(rows, dtype=torch.int64))
