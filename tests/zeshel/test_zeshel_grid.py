"""Grid tabulation: cells from run summaries, the Table-1-style Markdown, verdicts, the chart."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from dist_nce.core.config import load_config
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute
from dist_nce.zeshel.grid import cell, comparison_text, comparisons, markdown_table, noise_note, plot

BASE = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "retriever_tiny_cpu.yaml"


def summary(val: float, test: float) -> dict:
    def rep(own, worlds):
        entry = lambda v: {"recall@64": {"macro": v, "micro": v + 0.01}, "accuracy": {"macro": v / 10}}  # noqa: E731
        return {"worlds": worlds, "own_world": {**entry(own), "n_mentions": 400}, "split_union": entry(own / 2)}

    return {"done": True, "seconds": 1.0, "dev_split": "heldout_train_seen", "dev_after": {"recall@64": 0.5},
            "zeshel": {"val": rep(val, {"a": [0, 128], "b": [128, 384]}),
                                                      "test": rep(test, {"c": [0, 32]})}}


def cfg(preset: str, mode: str, m: int | None = None) -> ZeshelRetrieverConfig:
    sets = [f"model.retriever.preset={preset}", f"negatives.mode={mode}",
            *(["service.index.backend=torch"] if preset == "som" else [])]  # faiss serves inner products only
    return load_config(ZeshelRetrieverConfig, BASE, sets + ([f"model.retriever.m={m}"] if m else []))


@pytest.fixture
def cells():
    return [cell("dual_random", cfg("dual", "random"), summary(0.30, 0.20), losses=[3.0] * 10 + [1.0] * 10),
            cell("dual_hard", cfg("dual", "hard"), summary(0.40, 0.25)),
            cell("multi8_random", cfg("multi", "random", 8), summary(0.30, 0.30)),
            cell("multi8_mixed", cfg("multi", "mixed", 8), summary(0.35, 0.29))]


def test_cell(cells):
    c = cells[0]
    assert (c["architecture"], c["negatives"]) == ("dual", "random") and cells[3]["negatives"] == "mixed-50"
    assert cells[2]["architecture"] == "multi-8"
    assert c["val/own_world/macro"] == 0.30 and c["val/split_union/micro"] == pytest.approx(0.16)
    assert c["val/chance"] == pytest.approx((0.5 + 0.25) / 2) and c["test/chance"] == 1.0  # min(1, 64 / 32)
    assert (c["loss_first"], c["loss_last"]) == (3.0, 1.0)
    empty = cell("x", cfg("som", "hard"), {"done": False})
    assert math.isnan(empty["val/own_world/macro"]) and "loss_first" not in empty
    assert c["heldout/recall"] == 0.5 and math.isnan(empty["heldout/recall"])


def test_table_and_verdicts(cells):
    table = markdown_table(cells).splitlines()
    assert table[0].startswith("| architecture | negatives | val R@64 (own world)")
    assert table[2] == "| (random ranking) | - | 37.50 | 100.00 | - | - | - | - | - |"
    assert table[4] == "| dual | hard | 40.00 | 25.00 | 20.00 | 12.50 | 4.00 | 2.50 | 50.00 |"
    verdicts = comparisons(cells)
    assert [(v["architecture"], v["negatives"], v["beats_random"]) for v in verdicts] == [
        ("dual", "hard", True), ("multi-8", "mixed-50", False)]  # test: 0.29 < 0.30
    assert verdicts[1]["delta_val"] == pytest.approx(0.05)
    text = comparison_text(verdicts)
    assert ("multi-8: mixed-50 vs random: val +5.00, test -1.00 points -> does not beat random at R@k "
            "(R@1: val +0.50, test -0.10); within the noise (under 2 standard errors on val or test, one seed)") \
        in text
    # 400 mentions a split: 2 standard errors are 5 points; +15 and +15 are outside them, +15 and +2 are not
    far = comparisons([cells[0], cell("dual_hard", cfg("dual", "hard"), summary(0.45, 0.35))])
    near = comparisons([cells[0], cell("dual_hard", cfg("dual", "hard"), summary(0.45, 0.22))])
    assert (far[0]["within_noise"], near[0]["within_noise"]) == (False, True)
    assert far[0]["beats_random"] and "within the noise" not in comparison_text(far)


def test_untrained_is_no_verdict_and_noise_note(cells):
    untrained = cell("dual_untrained", cfg("dual", "random"), summary(0.9, 0.9), negatives="untrained")
    assert [v["negatives"] for v in comparisons([untrained, *cells])] == ["hard", "mixed-50"]
    assert noise_note(cells) == ("val: 400 mentions, one mention = 0.25 points, standard error <= 2.5 points; "
                                 "test: 400 mentions, one mention = 0.25 points, standard error <= 2.5 points")


def test_plot(cells, tmp_path):
    plot(cells, tmp_path / "g.png", "title")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_result_key_changes_with_what_the_result_depends_on_only(tmp_path):
    import dataclasses

    from dist_nce.zeshel.grid import input_fingerprints, keyed, result_key

    base = cfg("dual", "hard")
    key = result_key(base, ["train-store", "eval-store"])
    moved = dataclasses.replace(base, run=dataclasses.replace(base.run, name="elsewhere", output_dir="/x",
                                                              storage_path="/y", progress=True))
    assert result_key(moved, ["train-store", "eval-store"]) == key  # where it runs is not what it computes
    # nor where a job of it stops or checkpoints (resumes are exact): a grid time-boxed with
    # stop_after_steps continues its rows when run again without it, instead of starting them over
    boxed = dataclasses.replace(base, run=dataclasses.replace(base.run, stop_after_steps=3, checkpoint_every_steps=1,
                                                              num_to_keep=5))
    assert result_key(boxed, ["train-store", "eval-store"]) == key
    # nor where its inputs are: `ray job submit --working-dir` runs each submission from another copy of the
    # project (every absolute path moved); what the paths hold is in the fingerprints
    elsewhere = absolute(base, "/tmp/ray/session_2/runtime_resources/working_dir_files/_ray_pkg_1")
    assert elsewhere.deepspeed.config != absolute(base).deepspeed.config
    assert result_key(elsewhere, ["train-store", "eval-store"]) == result_key(absolute(base), ["train-store", "eval-store"]) == key
    other_lr = dataclasses.replace(base, optim=dataclasses.replace(base.optim, lr=1e-3))
    assert result_key(other_lr, ["train-store", "eval-store"]) != key
    assert result_key(base, ["regenerated-train-store", "eval-store"]) != key  # same config, other data
    assert result_key(cfg("dual", "random"), ["train-store", "eval-store"]) != key
    # The untrained model's key ignores the training settings, not the data or model.
    assert result_key(other_lr, ["t", "e"], ("model", "data", "zeshel")) == \
        result_key(base, ["t", "e"], ("model", "data", "zeshel"))

    run = keyed(base, "dual_hard", tmp_path, key)
    assert run.run.output_dir == str(tmp_path / f"dual_hard-{key}")
    assert run.run.name.startswith(f"zeshel_grid_dual_hard-{key}-") and run.run.storage_path == base.run.storage_path
    # another grid (--out) of the same row: its own Ray Train run in the shared storage, not the first grid's
    # checkpoints (it resumed them at their last step and trained nothing); the same grid again: the same run
    assert keyed(base, "dual_hard", tmp_path / "other", key).run.name != run.run.name
    assert keyed(base, "dual_hard", tmp_path / "." , key).run.name == run.run.name

    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"a" * 100)
    with_model = dataclasses.replace(base, model=dataclasses.replace(
        base.model, retriever=dataclasses.replace(base.model.retriever, mention_model=str(model))))
    before = input_fingerprints(with_model)
    (model / "weights.bin").write_bytes(b"b" * 100)  # rebuilt in place
    after = input_fingerprints(with_model)
    assert after != before and len(before) == 2 and after[1:] == before[1:]  # the model's, then the DeepSpeed JSON's
    # a start (model.init_from) or a BLINK checkpoint retrained in place, a DeepSpeed JSON edited in place
    start, ds = tmp_path / "start", tmp_path / "ds.json"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"a" * 100)
    ds.write_text('{"train_micro_batch_size_per_gpu": "auto"}')
    warm = dataclasses.replace(with_model, model=dataclasses.replace(with_model.model, init_from=str(start)),
                               deepspeed=dataclasses.replace(with_model.deepspeed, config=str(ds)))
    first = input_fingerprints(warm)
    (start / "model.safetensors").write_bytes(b"c" * 100)
    second = input_fingerprints(warm)
    ds.write_text('{"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": true}}')
    third = input_fingerprints(warm)
    assert len({first[1], second[1], third[1]}) == 2 and first[1].startswith("init_from:")
    assert len({first[2], second[2], third[2]}) == 2 and first[2].startswith("deepspeed:")
    blink = tmp_path / "biencoder.bin"
    blink.write_bytes(b"d" * 100)
    from_blink = dataclasses.replace(base, model=dataclasses.replace(base.model, blink_checkpoint=str(blink)))
    fp = input_fingerprints(from_blink)
    blink.write_bytes(b"e" * 100)
    assert input_fingerprints(from_blink)[1] != fp[1] and fp[1].startswith("blink_checkpoint:")


def test_a_wrong_key_in_a_row_is_blamed_on_the_rows_file_and_the_row(tmp_path):
    from dist_nce.core.config import ConfigError
    from dist_nce.zeshel.grid import load_rows, row_config

    rows_file = tmp_path / "rows.yaml"
    rows_file.write_text("rows:\n  - name: dual_random\n    set: [negatives.mode=random]\n"
                         "  - name: dual_hard\n    set: [model.retriever.preset=dual, negatives.mod=hard]\n")
    ok, bad = load_rows(rows_file)
    assert row_config(BASE, ok, tmp_path).negatives.mode == "random"
    with pytest.raises(ConfigError) as e:
        row_config(BASE, bad, tmp_path)
    assert str(e.value).startswith(f"{rows_file}: row 'dual_hard': negatives.mod: unknown key for NegativesConfig")
    # A wrong grid-wide --set is still the --set's, not the row's.
    with pytest.raises(ConfigError, match=r"^--set \(over .*retriever_tiny_cpu\.yaml\): optim\.lr: -1\.0: must be > 0"):
        row_config(BASE, ok, tmp_path, ["optim.lr=-1"])


def test_a_rows_file_with_a_repeated_key_is_refused(tmp_path):
    from dist_nce.core.config import ConfigError
    from dist_nce.zeshel.grid import load_rows

    rows_file = tmp_path / "rows.yaml"
    rows_file.write_text("rows:\n  - name: a\n    set: [negatives.mode=hard]\n    set: [negatives.mode=random]\n")
    with pytest.raises(ConfigError, match=r"rows\.yaml:4: duplicate key 'rows\[0\]\.set' \(first at line 3\)"):
        load_rows(rows_file)


def test_a_ctrl_c_says_how_the_grid_goes_on(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Ctrl-C while the grid prepares its stores, or while a row trains (Ray Train aborts its run, the driver's
    ray.get raises SystemExit(1)): status 130 and what the same command does next, as the retriever job says it,
    instead of a traceback or status 1 with no word. The grid's own steps around them run as they are."""
    from dist_nce.cli import zeshel_grid

    rows = tmp_path / "rows.yaml"
    rows.write_text("rows:\n  - name: dual_random\n    set: [negatives.mode=random]\n")
    argv = ["--config", str(BASE), "--rows", str(rows), "--out", str(tmp_path / "grid"), "--no-untrained",
            "--set", f"model.retriever.mention_model={tiny_model_dir}", "--set", f"run.storage_path={tmp_path / 'ray'}",
            "--set", f"data.prepared_dir={tmp_path / 'train'}", "--set", f"zeshel.eval_store={tmp_path / 'eval'}"]

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dist_nce.zeshel.data.ensure_zeshel_stores", stopped)
    capsys.readouterr()
    # (and a grid --set that the row sets again is named: the row's value is the one used)
    assert zeshel_grid.main([*argv, "--set", "negatives.mode=hard"]) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"[grid] dual_random: the row sets negatives.mode over the grid's --set (the row's value "
                          f"is used; {rows})\n"), err
    assert zeshel_grid.main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted while preparing the data ({tmp_path / 'eval'}, {tmp_path / 'train'}): the chunks " \
                  "done are kept; run the same command again to resume\n", err

    def aborted(*a, **k):
        raise SystemExit(1)  # what ray.get raises in the driver once Ray Train aborted the run

    monkeypatch.setattr("dist_nce.zeshel.data.ensure_zeshel_stores", lambda cfg, log: ("train", "eval"))
    monkeypatch.setattr("dist_nce.index.encode.store_fingerprint", lambda store: f"fingerprint of {store}")
    monkeypatch.setattr("dist_nce.zeshel.run.run_retriever", aborted)
    assert zeshel_grid.main(argv) == 130
    captured = capsys.readouterr()
    assert "[grid] dual_random: training dual with random negatives" in captured.out
    assert captured.err == "[grid] dual_random: the rows before it are done and kept\n" \
        "interrupted before a whole checkpoint was written: the same command again starts the run over\n", captured.err


def test_a_time_boxed_grid_lists_stopped_rows_and_continues_them(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """``--set run.stop_after_steps=N``: a row the job stopped has no recall yet. It is listed as unfinished,
    not tabulated as a row of dashes with a "does not beat random" verdict; and the next run, with N raised or
    unset, continues the same row (same directory, so the same Ray Train run) instead of starting it over."""
    import json

    from dist_nce.cli import zeshel_grid

    rows = tmp_path / "rows.yaml"
    rows.write_text("rows:\n  - name: dual_random\n    set: [negatives.mode=random]\n"
                    "  - name: dual_hard\n    set: [negatives.mode=hard]\n")
    out = tmp_path / "grid"
    argv = ["--config", str(BASE), "--rows", str(rows), "--out", str(out), "--no-untrained",
            "--set", f"model.retriever.mention_model={tiny_model_dir}", "--set", f"run.storage_path={tmp_path / 'ray'}",
            "--set", f"data.prepared_dir={tmp_path / 'train'}", "--set", f"zeshel.eval_store={tmp_path / 'eval'}"]
    runs: list[tuple[str, str, int]] = []

    def run_retriever(cfg, progress, log):  # the rows' own runs: what run_retriever returns and leaves
        d = Path(cfg.run.output_dir)
        d.mkdir(parents=True, exist_ok=True)
        stop = cfg.run.stop_after_steps
        runs.append((cfg.negatives.mode, str(d), stop))
        done = cfg.negatives.mode == "random" or not stop
        result = {**summary(0.30, 0.20), "step": 20} if done else {"done": False, "step": stop, "seconds": 1.0}
        (d / "metrics.jsonl").write_text('{"step": 0, "train/loss": 2.0}\n')
        if done:
            (d / "summary.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr("dist_nce.zeshel.data.ensure_zeshel_stores", lambda cfg, log: ("train", "eval"))
    monkeypatch.setattr("dist_nce.index.encode.store_fingerprint", lambda store: f"fingerprint of {store}")
    monkeypatch.setattr("dist_nce.zeshel.run.run_retriever", run_retriever)
    assert zeshel_grid.main([*argv, "--set", "run.stop_after_steps=3"]) == 0
    printed = capsys.readouterr().out
    grid = json.loads((out / "grid.json").read_text())
    assert [c["name"] for c in grid["cells"]] == ["dual_random"] and grid["comparisons"] == []
    assert grid["unfinished"] == ["dual_hard (at step 3)"]
    md = (out / "grid.md").read_text()
    assert "| dual | hard |" not in md and "hard vs random" not in md
    assert "Do hard / mixed negatives beat random" not in md  # no finished row to answer it: no empty section
    assert "Not finished, so not in the table: dual_hard (at step 3) (stopped at run.stop_after_steps; run the " \
           "grid again with it raised or unset to continue them)." in md and md.strip() in printed

    # the same grid without the stop: the finished row is reused, the stopped one continues in its directory
    assert zeshel_grid.main(argv) == 0
    assert [(mode, stop) for mode, _, stop in runs] == [("random", 3), ("hard", 3), ("hard", 0)]
    assert runs[2][1] == runs[1][1]
    grid = json.loads((out / "grid.json").read_text())
    assert [c["name"] for c in grid["cells"]] == ["dual_random", "dual_hard"] and grid["unfinished"] == []
    assert [(v["negatives"], v["beats_random"]) for v in grid["comparisons"]] == [("hard", False)]
    assert "Do hard / mixed negatives beat random (own world, val and test)?\n\n- dual: hard vs random" in \
        (out / "grid.md").read_text()


def test_a_grid_or_a_row_in_use_is_refused(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """One live grid per --out, refused before its stores are prepared (a --dry-run of it still checks); and a
    row whose run directory another job holds (the retriever job started on it by hand, say) stops the grid
    before that row trains, as the row's own job would be stopped."""
    import os

    from dist_nce.cli import zeshel_grid
    from dist_nce.core.run_lock import acquire

    rows = tmp_path / "rows.yaml"
    rows.write_text("rows:\n  - name: dual_random\n    set: [negatives.mode=random]\n")
    out = tmp_path / "grid"
    argv = ["--config", str(BASE), "--rows", str(rows), "--out", str(out), "--no-untrained",
            "--set", f"model.retriever.mention_model={tiny_model_dir}", "--set", f"run.storage_path={tmp_path / 'ray'}",
            "--set", f"data.prepared_dir={tmp_path / 'train'}", "--set", f"zeshel.eval_store={tmp_path / 'eval'}"]
    prepared, trained = [], []
    monkeypatch.setattr("dist_nce.zeshel.data.ensure_zeshel_stores",
                        lambda cfg, log: prepared.append(cfg) or ("train", "eval"))
    monkeypatch.setattr("dist_nce.index.encode.store_fingerprint", lambda store: f"fingerprint of {store}")
    monkeypatch.setattr("dist_nce.zeshel.run.run_retriever",  # stops unfinished: the next grid trains it again
                        lambda cfg, progress, log: trained.append(cfg.run.output_dir) or {"done": False, "step": 1})
    capsys.readouterr()
    with acquire(out):
        assert zeshel_grid.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: grid directory {out} is in use by another job (pid {os.getpid()} on host "), err
        assert err.endswith("wait for it to end, stop it, or use another --out\n") and err.count("\n") == 1, err
        assert prepared == [] and trained == []
        assert zeshel_grid.main([*argv, "--dry-run"]) == 0
    assert zeshel_grid.main(argv) == 0 and len(trained) == 1
    row_dir = Path(trained[0])
    capsys.readouterr()
    with acquire(row_dir):
        assert zeshel_grid.main(argv) == 2
    assert len(trained) == 1
    assert capsys.readouterr().err.startswith(f"error: run directory {row_dir} is in use by another job (pid "
                                              f"{os.getpid()} on host ")
    assert zeshel_grid.main(argv) == 0 and len(trained) == 2  # free again: the row trains
