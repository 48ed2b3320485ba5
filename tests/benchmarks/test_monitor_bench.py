"""benchmarks/monitor.py at toy size: both ways do the same work and agree, and the committed
mini paper's SOM monitor shares are found for the projection."""
from __future__ import annotations

import torch

from benchmarks import monitor
from dist_nce.modeling.scoring import ScoreSpec


def test_before_and_after_draw_the_same_sets_and_agree_on_the_bias():
    spec = ScoreSpec.preset("som")
    ents, probe = monitor.som_kb(60, 8, 4, 3)
    for hard in (True, False):
        (sets_a, bias_a), (sets_b, bias_b) = (monitor.measurement(spec, ents, probe, 4, 5, hard, shared, 32)
                                              for shared in (False, True))
        assert sets_a.shape == (3, 4, 6) and torch.equal(sets_a, sets_b)
        assert (sets_a[:, :, 0] == (torch.arange(3) * 7)[:, None]).all()  # gold first
        torch.testing.assert_close(bias_a, bias_b, rtol=0, atol=1e-5)
        assert bias_a.shape == probe.vecs.shape and bool(bias_a.abs().sum() > 0)


def test_committed_shares_are_read_per_arm():
    costs = monitor.committed_costs()
    assert {"random", "hard", "mixed50"} <= set(costs)  # and the shared warm-up start
    assert all(len(costs[arm]) == 3 and all(0 < x < 1 for x in costs[arm]) for arm in ("random", "hard", "mixed50"))
