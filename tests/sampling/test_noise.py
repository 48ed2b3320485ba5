"""The Gumbel noise's two paths (dist_nce/sampling/noise.py): the hash and uniforms in
native/noise.c against the torch passes, bit for bit, in both layouts and for per-query rows;
``DIST_NCE_NATIVE=off`` keeps the torch passes (the pure-Python reference:
tests/sampling/test_negatives.py)."""
from __future__ import annotations

import pytest
import torch

from dist_nce.kernels import build as native
from dist_nce.sampling import noise as nz

NOISE_REASON = native.NOISE.unavailable_reason()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.skipif(NOISE_REASON is not None, reason=f"native noise unavailable: {NOISE_REASON}")
@pytest.mark.parametrize("batch,n", [(7, 1000), (130, 33), (1, 5), (64, 8191)])
def test_native_uniforms_give_the_torch_noise_bit_for_bit(batch, n, monkeypatch):
    g = gen(batch + n)
    keys = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=g)
    shared = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=g)
    own = torch.randint(0, 2 ** 62, (batch, n), generator=g)
    calls = [(seed, rows, first) for seed in (0, -9, 2 ** 62 + 5) for rows, first in
             ((shared, False), (shared, True), (own, False))]
    monkeypatch.setattr(native.NOISE, "exercised", False)
    fast = [nz.gumbel_noise(seed, keys, rows, rows_first=first) for seed, rows, first in calls]
    assert native.NOISE.exercised
    monkeypatch.setenv(native.SWITCH, "off")
    for got, (seed, rows, first) in zip(fast, calls):
        assert torch.equal(got, nz.gumbel_noise(seed, keys, rows, rows_first=first))
    assert torch.equal(fast[1], fast[0].T)  # rows first: the same values, transposed


def test_the_switch_keeps_the_torch_passes(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "off")
    monkeypatch.setattr(native.NOISE, "exercised", False)
    out = nz.gumbel_noise(3, torch.arange(4), torch.arange(10))
    assert out.shape == (4, 10) and torch.isfinite(out).all() and not native.NOISE.exercised
    with pytest.raises(ValueError, match="rows_first needs rows shared by all queries"):
        nz.gumbel_noise(3, torch.arange(4), torch.zeros(4, 10, dtype=torch.int64), rows_first=True)
