import math

import pytest

from dist_nce.minipaper.stats import against, curve_band, group, separation_chance, spread, verdict


def test_spread_is_mean_range_and_sample_std_with_nan_dropped():
    s = spread([0.2, 0.4, float("nan"), 0.6])
    assert s["n"] == 3 and s["values"] == [0.2, 0.4, 0.6]
    assert s["mean"] == pytest.approx(0.4) and s["min"] == 0.2 and s["max"] == 0.6
    assert s["std"] == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)
    assert spread([0.3])["std"] == 0.0
    empty = spread([float("nan"), None])
    assert empty["n"] == 0 and math.isnan(empty["mean"])


@pytest.mark.parametrize("a, b, expected", [
    ([0.5, 0.6, 0.7], [0.1, 0.2, 0.49], "wins"),
    ([0.1, 0.2, 0.3], [0.31, 0.5, 0.9], "loses"),
    ([0.5, 0.6, 0.7], [0.1, 0.2, 0.5], "tie"),     # touching ranges are not separated
    ([0.5, 0.9, 0.95], [0.1, 0.6, 0.7], "tie"),    # higher mean, overlapping ranges
    ([0.5], [], "tie"),
    ([0.9], [0.1, 0.2, 0.3], "tie"),               # one seed is no range
])
def test_verdict_needs_ranges_that_do_not_overlap(a, b, expected):
    assert verdict(spread(a), spread(b)) == expected


def test_group_and_against_compare_each_arm_with_random_of_its_architecture():
    rows = [{"architecture": arch, "arm": arm, "seed": s, "acc": base + 0.01 * s}
            for arch, offsets in (("dual", {"random": 0.1, "hard": 0.5}), ("som", {"random": 0.5, "hard": 0.51}))
            for arm, base in offsets.items() for s in range(3)]
    groups = group(rows, ("architecture", "arm"), ["acc"])
    assert [(g["architecture"], g["arm"], g["seeds"]) for g in groups] == [
        ("dual", "random", [0, 1, 2]), ("dual", "hard", [0, 1, 2]), ("som", "random", [0, 1, 2]),
        ("som", "hard", [0, 1, 2])]
    vs = {v["architecture"]: v for v in against(groups, ["acc"])}
    assert vs["dual"]["acc"]["verdict"] == "wins" and vs["dual"]["acc"]["delta_mean"] == pytest.approx(0.4)
    assert vs["som"]["acc"]["verdict"] == "tie"  # 0.51-0.53 against 0.50-0.52


def test_curve_band_keeps_the_steps_every_seed_has():
    steps, mean, lo, hi = curve_band([{0: 0.1, 10: 0.3, 20: 0.5}, {0: 0.3, 10: 0.5}])
    assert steps == [0, 10]
    assert mean == pytest.approx([0.2, 0.4]) and lo == [0.1, 0.3] and hi == [0.3, 0.5]
    assert curve_band([]) == ([], [], [], [])


def test_separation_chance_is_one_over_the_orderings_that_separate():
    import itertools
    import random

    assert separation_chance(3, 3) == pytest.approx(1 / 20) and separation_chance(2, 4) == pytest.approx(1 / 15)
    # by simulation: i.i.d. values, how often do all of the first 3 exceed all of the last 3?
    rng = random.Random(0)
    hits = sum(min(v[:3]) > max(v[3:]) for v in ([rng.random() for _ in range(6)] for _ in range(20000)))
    assert abs(hits / 20000 - 1 / 20) < 0.006
    # and by counting orderings exactly
    perms = list(itertools.permutations(range(6)))
    assert sum(min(p[:3]) > max(p[3:]) for p in perms) / len(perms) == pytest.approx(1 / 20)
    with pytest.raises(ValueError, match="both sides"):
        separation_chance(0, 3)

