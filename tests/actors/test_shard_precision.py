"""A shard holding its encoder's weights in bf16 (service.encode_weights: bf16): the reps stay within bf16
rounding of an fp32 shard's, each refresh's weights are cast into the same tensors and seen by the next
encode, and the version's manifest says how it was encoded (EntityShard as a plain object, as
tests/actors/test_shard.py does)."""
from __future__ import annotations

import torch

from tests.actors.test_shard import make_shard, states, store_dir  # noqa: F401  (fixtures)


def bf16_tolerance(layers: int) -> float:
    """tests/index/test_encode.py's bound: 1.5 x 2^-8 x sqrt(2 L + 1) relative L2 per row."""
    return 1.5 * 2.0 ** -8 * (2 * layers + 1) ** 0.5


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)).max())


def test_a_bf16_weight_shard_encodes_within_bf16_rounding_and_takes_every_refresh(store_dir, states, tmp_path):
    fp32 = make_shard(store_dir, tmp_path / "fp32")  # encode_dtype fp32: today's exact path
    bf16 = make_shard(store_dir, tmp_path / "bf16", encode_dtype="auto", encode_weights="bf16")
    tol = bf16_tolerance(2)  # tiny_model_dir: 2 layers
    got, held, tensors = [], None, None
    for version, state in enumerate(states[:3]):
        assert fp32.refresh(state, version) == bf16.refresh(state, version) == version
        if held is None:
            held = bf16._encoder
            tensors = [p.data_ptr() for p in held.parameters()]
        want, _ = fp32.versions.load(version)
        reps, manifest = bf16.versions.load(version)
        assert reps.vecs.dtype == want.vecs.dtype == torch.float32  # storage_dtype, whatever the compute
        assert 0 < rel_error(reps.vecs, want.vecs) <= tol, f"version {version}"
        assert manifest["encode_dtype"] == "bfloat16" and manifest["encode_weights"] == "bfloat16"
        got.append(reps.vecs)
    # built once; each refresh cast its weights into the same bf16 tensors
    assert bf16._encoder is held and [p.data_ptr() for p in held.parameters()] == tensors
    assert all(p.dtype == torch.bfloat16 for p in held.parameters())
    for a, b in zip(got, got[1:]):
        assert rel_error(b, a) > 10 * tol, "consecutive states encode far apart: each refresh saw new weights"
    assert fp32.versions.manifest(2)["encode_weights"] == "float32"
