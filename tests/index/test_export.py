"""export_snapshot: the FAISS/BLINK layout from per-shard persisted versions (no Ray)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.shard import EntityShard
from dist_nce.index.config import IndexConfig
from dist_nce.index.export import export_snapshot
from dist_nce.modeling.retriever import RetrieverConfig
from kb.store import EntityStore

from tests.actors.test_shard import D, N, entity_state, store_dir  # noqa: F401  (store_dir is a fixture)

SPLIT = [(0, 40), (40, N)]


def persisted_parts(store_dir, tiny_model_dir, root, preset, m=None):
    config = ServiceConfig(encode_dtype="fp32", index=IndexConfig(backend="torch"))
    retriever = RetrieverConfig(preset=preset, m=m, storage_dtype="float16")
    state = entity_state(tiny_model_dir, preset, m)
    parts, tensors = [], []
    for i, rows in enumerate(SPLIT):
        shard = EntityShard(store_dir, rows, i, len(SPLIT), retriever, config, str(root), D)
        shard.refresh(state, 0)
        parts.append((rows, shard.versions.path(0)))
        tensors.append(shard.versions.load(0)[0])
    return parts, tensors


def test_multi_vector_export_with_mask_ids_and_blink_tensor(store_dir, tiny_model_dir, tmp_path):
    parts, tensors = persisted_parts(store_dir, tiny_model_dir, tmp_path / "shards", "multi", 3)
    store = EntityStore(store_dir)
    manifest = export_snapshot(tmp_path / "out", store, parts, blink_t7=True, model="tiny")
    out = tmp_path / "out"
    vecs = np.load(out / "embeddings.npy")
    assert vecs.dtype == np.float32 and vecs.shape == (N, 3, D) and manifest["shape"] == [N, 3, D]
    want = torch.cat([t.vecs for t in tensors]).float().numpy()
    np.testing.assert_array_equal(vecs, want)
    mask = np.load(out / "mask.npy")
    np.testing.assert_array_equal(mask, torch.cat([t.mask for t in tensors]).numpy())
    assert not vecs[~mask].any(), "padded positions are zero"
    ids = (out / "ids.txt").read_text().splitlines()
    assert ids == store.source_ids(np.arange(N)) and ids[:2] == ["1000", "1001"]
    blink = torch.load(out / "embeddings.t7", weights_only=True)
    assert blink.dtype == torch.float32 and torch.equal(blink, torch.from_numpy(vecs))
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["kind"] == "embedding_snapshot" and on_disk["model"] == "tiny"
    assert on_disk["files"] == {"embeddings": "embeddings.npy", "ids": "ids.txt", "mask": "mask.npy",
                                "blink_t7": "embeddings.t7"}
    assert [p["rows"] for p in on_disk["parts"]] == [list(r) for r in SPLIT]


def test_dual_export_is_a_plain_matrix_and_ranges_must_tile_the_store(store_dir, tiny_model_dir, tmp_path):
    parts, tensors = persisted_parts(store_dir, tiny_model_dir, tmp_path / "shards", "dual")
    store = EntityStore(store_dir)
    export_snapshot(tmp_path / "out", store, parts, dtype="float16")
    vecs = np.load(tmp_path / "out" / "embeddings.npy")
    assert vecs.dtype == np.float16 and vecs.shape == (N, D)
    np.testing.assert_array_equal(vecs, torch.cat([t.vecs for t in tensors]).numpy())
    assert not (tmp_path / "out" / "mask.npy").exists()
    with pytest.raises(ValueError, match="do not tile"):
        export_snapshot(tmp_path / "bad", store, parts[1:])
