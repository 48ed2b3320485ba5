"""benchmarks/gpu.py at tiny size on a CPU (Triton interpreted): the law section passes, the
JSON records the device, and one call of the fused path runs a fixed number of operators per
chunk with no host synchronisation inside the chunk loop (what the GPU run reports)."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu
from dist_nce.index.exact import exact_search
from dist_nce.kernels import block_reduce
from dist_nce.modeling.scoring import Reps, ScoreSpec

pytestmark = [pytest.mark.skipif(block_reduce.available("cpu") is not None, reason=str(block_reduce.available("cpu"))),
              pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")]  # empty blocks


def test_law_section_passes_and_records_the_device(tmp_path):
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "law", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_law.json").read_text())
    assert data["passed"] and data["sharded_equals_flat"] and data["kernel"] == "triton"
    assert data["info"]["torch"] == torch.__version__ and "triton" in data["info"]
    assert data["peak"]["tflops_best"] > 0


@pytest.mark.parametrize("seed", [1, None], ids=["sampler", "topk"])
def test_operators_per_chunk_are_a_small_constant_and_never_sync(seed):
    g = torch.Generator().manual_seed(0)
    e = torch.randn(8192, 32, generator=g).bfloat16()
    q = torch.randn(8, 32, generator=g).bfloat16().float()
    gold = torch.randint(0, 8192, (8,), generator=g)

    def call(chunk):
        return lambda: exact_search(ScoreSpec.preset("dual"), Reps(q), Reps(e), 0, 63, gold, chunk, seed=seed,
                                    query_keys=torch.arange(8), sampler="block", block_rows=128, kernel="triton")
    counts = {chunk: gpu.op_counts(call(chunk), torch.device("cpu")) for chunk in (4096, 2048, 1024)}
    assert [counts[c]["triton_launches"] for c in (4096, 2048, 1024)] == [2, 4, 8]
    per_chunk = [(counts[b]["operators_not_views"] - counts[a]["operators_not_views"]) / (8192 // b - 8192 // a)
                 for a, b in ((4096, 2048), (2048, 1024))]
    assert per_chunk[0] == per_chunk[1] and per_chunk[0] <= 30, per_chunk  # a constant, and small
    assert counts[4096]["host_syncs"] == counts[1024]["host_syncs"] <= 3  # at the end only, not per chunk


def test_shard_section_compares_every_call_of_the_service_and_fails_on_a_difference(tmp_path, monkeypatch):
    """On a CPU both shards are CPU shards (the GPU run puts one on the device): the section runs every call the
    service makes of a shard, for dual and multi-8, and a shard that answers differently fails it."""
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "shard", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_shard.json").read_text())
    calls = ("topk", "gumbel_topk", "score_rows", "lse_grad_all", "lse_grad_rows")
    assert data["passed"] and all(data[f"{a}_{c}_on_host"] for a in ("dual", "multi8") for c in calls)
    assert data["dual_topk_ids_equal"] == 1.0 and data["multi8_lse_grad_rows_max_diff"] == 0.0

    from dist_nce.index.live import LiveIndex

    plain, seen = LiveIndex.score_rows, []

    def off_on_the_device(self, queries, rows):  # the device's shard is asked first: 0.01 off there
        seen.append(1)
        return plain(self, queries, rows) + (0.01 if len(seen) % 2 else 0.0)
    monkeypatch.setattr(LiveIndex, "score_rows", off_on_the_device)
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "shard", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "gpu_shard.json").read_text())
    assert not data["passed"] and data["dual_score_rows_max_diff"] > 0.009
