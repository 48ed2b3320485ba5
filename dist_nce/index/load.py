"""Load a shard's persisted version into a ShardIndex at one copy of the vectors.

A shard (re)starting reads its newest persisted version and builds its index; at KILT scale
that is GBs per shard. Reading the file into a tensor and then building faiss from it holds
the vectors twice at the peak (the tensor and faiss's copy). Here single-vector versions are
read straight from the file into their final home (``ShardIndex.filled``: the preallocated
faiss storage for a CPU flat index), so the peak stays at the raw vector bytes plus small
buffers (issue 12: <= 1.3x raw at the peak of the build, not only at rest).
"""
from __future__ import annotations

import torch

from dist_nce.index.config import IndexConfig
from dist_nce.index.search import ShardIndex
from dist_nce.index.versions import PersistedVersions
from dist_nce.modeling.scoring import ScoreSpec


def load_shard_index(versions: PersistedVersions, version: int, spec: ScoreSpec, row_start: int,
                     config: IndexConfig) -> tuple[ShardIndex, dict]:
    """(index, manifest) of persisted ``version``; :class:`ArtifactMismatch` if it is not valid."""
    manifest = versions.manifest(version)
    if manifest["has_mask"]:  # multi-vector reps: faiss holds a flattened copy anyway
        reps, manifest = versions.load(version)
        return ShardIndex(spec, reps, row_start, config, version), manifest
    dtype = getattr(torch, manifest["dtype"])
    index = ShardIndex.filled(spec, tuple(manifest["shape"]), dtype,
                              lambda out: versions.read_vecs_into(version, out), row_start, config, version)
    return index, manifest
