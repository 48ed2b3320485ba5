"""dist_nce/minipaper/results.py: what a cell's run left behind, as one row of numbers."""


def test_a_trained_cells_row_carries_its_median_step_time(tmp_path):
    """Issue 36's staleness ablation reports steps/s beside recall: the median logged step (waits included)."""
    import json

    from dist_nce.minipaper.results import aida_row

    lines = [{"step": s, "time/step_s": t, "train/loss": 1.0} for s, t in ((10, 0.5), (20, 0.2), (30, 0.25))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    row = aida_row(tmp_path, {"dev_after": {"recall@1": 0.5}})
    assert row["train/step_s"] == 0.25 and row["train/steps_per_s"] == 4.0 and row["dev/R@1"] == 0.5
    (tmp_path / "metrics.jsonl").write_text("")
    assert "train/step_s" not in aida_row(tmp_path, {})
