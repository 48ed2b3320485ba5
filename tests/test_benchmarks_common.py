"""benchmarks/common.py hygiene helpers (issue 12): the load guard, interleaving, spreads."""
from __future__ import annotations


import pytest


from benchmarks.common import compare, interleaved, load_guard, spread  # noqa: E402


def test_load_guard_refuses_a_busy_machine_unless_forced(capsys):
    assert load_guard(False, load=0.4) == {"load_average_before": 0.4, "load_limit": 1.5, "noisy": False}
    with pytest.raises(SystemExit, match="load average 3.20 > 1.5.*--force"):
        load_guard(False, load=3.2)
    assert load_guard(True, load=3.2)["noisy"] is True
    assert "NOISY" in capsys.readouterr().out


def test_interleaved_alternates_methods_and_keeps_the_spread():
    calls = []
    out = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1,
                      before={"b": lambda: calls.append("set-b")})
    assert calls == ["a", "set-b", "b"] * 4  # A B A B ..., warm-up round included
    for name in "ab":
        s = out[name]
        assert s["repeats"] == 3 and len(s["seconds"]) == 3 and s["min"] <= s["median"] <= s["max"]


def test_compare_calls_a_difference_only_when_spreads_are_apart():
    base = spread([1.0, 1.1, 1.2])
    apart = compare(spread([1.5, 1.6, 1.9]), base)
    assert apart["distinct"] and apart["x_median"] == pytest.approx(1.6 / 1.1)
    assert apart["x_low"] == pytest.approx(1.5 / 1.2) and apart["x_high"] == pytest.approx(1.9 / 1.0)
    assert not compare(spread([1.15, 1.3, 1.4]), base)["distinct"]  # overlapping: no difference called
