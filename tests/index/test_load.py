"""Loading a persisted version at one copy of the vectors (dist_nce.index.load, ShardIndex.filled)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.index.config import IndexConfig
from dist_nce.index.faiss_backend import faiss_storage_view
from dist_nce.index.load import load_shard_index
from dist_nce.index.search import ShardIndex
from dist_nce.index.versions import PersistedVersions
from dist_nce.modeling.scoring import Reps, ScoreSpec

DUAL = ScoreSpec.preset("dual")


def _saved(tmp_path, vecs: torch.Tensor, mask=None) -> PersistedVersions:
    versions = PersistedVersions(tmp_path / "shard", {"rows": [100, 100 + vecs.shape[0]]})
    versions.save(3, Reps(vecs, mask))
    return versions


@pytest.mark.parametrize("cfg", [IndexConfig(backend="flat"), IndexConfig(backend="flat", storage="fp16"),
                                 IndexConfig(backend="torch", chunk_rows=64),
                                 IndexConfig(backend="torch", chunk_rows=64, score_dtype="bf16")],
                         ids=["flat-fp32", "flat-fp16", "torch", "torch-bf16"])
def test_loaded_index_answers_as_the_one_built_from_the_tensor(tmp_path, cfg):
    vecs = torch.randn(500, 16, generator=torch.Generator().manual_seed(0))
    versions = _saved(tmp_path, vecs)
    index, manifest = load_shard_index(versions, 3, DUAL, 100, cfg)
    ref = ShardIndex(DUAL, Reps(vecs), 100, cfg, 3)
    assert manifest["version"] == 3 and index.version == 3 and index.num_rows == 500
    q, gold = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([100, 7, 599, -1])
    for a, b in ((index.topk(q, 9, gold), ref.topk(q, 9, gold)),
                 (index.gumbel_topk(q, 9, gold, 5, torch.arange(4)), ref.gumbel_topk(q, 9, gold, 5, torch.arange(4)))):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    assert torch.equal(index.entities.vecs, ref.entities.vecs)


def test_flat_fp32_reps_are_the_faiss_storage_filled_in_place(tmp_path):
    vecs = torch.randn(300, 8, generator=torch.Generator().manual_seed(2))
    versions = _saved(tmp_path, vecs)
    seen = []

    def fill(out):
        seen.append(out)
        versions.read_vecs_into(3, out)

    index = ShardIndex.filled(DUAL, (300, 8), torch.float32, fill, 0, IndexConfig(backend="flat"))
    codes = faiss_storage_view(index._faiss, 300, 8, torch.float32)
    # the one buffer the file was read into is faiss's own storage, and the torch reps view it
    assert seen[0].data_ptr() == codes.data_ptr() == index.entities.vecs.data_ptr()
    assert torch.equal(codes, vecs)


def test_read_vecs_into_refuses_what_does_not_match(tmp_path):
    versions = _saved(tmp_path, torch.randn(10, 4))
    with pytest.raises(ValueError, match=r"contiguous CPU float32 \[10, 4\]"):
        versions.read_vecs_into(3, torch.empty(10, 5))
    (versions.path(3) / "embeddings.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ArtifactMismatch, match="unreadable"):
        versions.read_vecs_into(3, torch.empty(10, 4))
    masked = PersistedVersions(tmp_path / "m", {})
    masked.save(0, Reps(torch.randn(5, 2, 4), torch.ones(5, 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="has a mask"):
        masked.read_vecs_into(0, torch.empty(5, 2, 4))


@pytest.mark.slow
def test_peak_memory_of_a_load_is_at_most_1_3x_the_raw_vectors(tmp_path):
    # In a fresh process: peak RSS (VmHWM) growth while loading a 128 MiB flat fp32 shard.
    n, d = 262_144, 128
    versions = _saved(tmp_path, torch.randn(n, d))
    script = textwrap.dedent(f"""
        import torch, faiss
        from dist_nce.index.load import load_shard_index
        from dist_nce.index.config import IndexConfig
        from dist_nce.index.versions import PersistedVersions
        from dist_nce.modeling.scoring import ScoreSpec

        def hwm():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

        torch.randn(8, 8) @ torch.randn(8, 8)
        before = hwm()
        index, _ = load_shard_index(PersistedVersions({str(tmp_path / 'shard')!r}, {{}}), 3,
                                    ScoreSpec.preset("dual"), 0, IndexConfig(backend="flat"))
        print((hwm() - before) / ({n} * {d} * 4))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) <= 1.3
