"""jobs/mini_paper.py starts its Ray head only when a cell left to run needs one (``needs_ray``), with room for
``parallel`` cells at once (``head_cpus``)."""
from __future__ import annotations

import json
from pathlib import Path

from dist_nce.cli.mini_paper import ROOT, check_cells, head_cpus, needs_ray, planned_cells
from dist_nce.core.config import load_config
from dist_nce.minipaper.config import MiniPaperConfig

CONFIG = "configs/mini_paper/minilm_table2_gpu.yaml"  # Table 2 with reranker run.backend: local


def _finish(cells: dict, out: Path, skip: str = "") -> None:
    for name, c in cells.items():
        if name != skip:
            d = c.dir(out, ROOT)
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"done": True}))


def test_no_head_when_only_local_reranker_cells_are_left(tmp_path):
    cfg = load_config(MiniPaperConfig, ROOT / CONFIG)
    parts = ["zeshel", "reranker"]
    cells = planned_cells(cfg, parts)
    assert needs_ray(cfg, parts, cells, tmp_path / "fresh")  # retriever cells to run: the head is needed
    _finish(cells, tmp_path / "one_left", skip="zeshel-dual-hard-s1")
    assert needs_ray(cfg, parts, cells, tmp_path / "one_left")
    _finish(cells, tmp_path / "done")
    assert not needs_ray(cfg, parts, cells, tmp_path / "done")
    ray_rerankers = load_config(MiniPaperConfig, ROOT / CONFIG, ["reranker.set=[run.backend=ray]"])
    assert needs_ray(ray_rerankers, parts, cells, tmp_path / "done")


def _head(config: str, *sets: str) -> tuple[MiniPaperConfig, int]:
    cfg = load_config(MiniPaperConfig, ROOT / config, list(sets))
    parts = ["zeshel", "reranker"] if cfg.reranker.enabled else ["zeshel"]
    return cfg, head_cpus(cfg, parts, check_cells(planned_cells(cfg, parts)))


def test_the_head_holds_parallel_cells_of_the_most_demanding_kind():
    # the frozen-tower grid: a cell asks for 0.5 (shard) + 1 (worker) CPUs: two a cell, as before
    cfg, cpus = _head("configs/mini_paper/minilm_cpu.yaml")
    assert (cfg.parallel, cpus) == (2, 4)
    # issue 36's GPU grid: 2 (shard) + 2 (worker) a cell, three at once; a head of 2 x 3 = 6 held one cell and
    # the next one's shard, whose worker then waited for the first cell to end
    cfg, cpus = _head("configs/mini_paper/minilm_both_towers_gpu.yaml")
    assert (cfg.parallel, cpus) == (3, 12)
    cfg, cpus = _head("configs/mini_paper/minilm_both_towers_gpu.yaml", "parallel=1")
    assert cpus == 4
    # Table 2's rerankers count when they train through Ray (backend local: in the job's own process)
    _, local = _head(CONFIG)
    _, ray_rerankers = _head(CONFIG, "reranker.set=[run.backend=ray, run.cpus_per_worker=3]")
    assert (local, ray_rerankers) == (2, 3)


def test_a_grid_in_use_is_refused_before_its_head_starts(tmp_path, capsys):
    """One live mini-paper per --out: a second one stops with status 2 and one line naming the directory and
    its holder, before any Ray head or cell (each cell's job holds its own run); a --dry-run still checks."""
    import os

    from dist_nce.cli.mini_paper import main
    from dist_nce.core.run_lock import acquire

    out = tmp_path / "out"
    argv = ["--config", str(ROOT / "configs" / "mini_paper" / "tiny_cpu.yaml"), "--out", str(out), "--only", "aida"]
    with acquire(out):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: grid directory {out} is in use by another job (pid {os.getpid()} on host "), err
        assert err.endswith("wait for it to end, stop it, or use another --out\n") and err.count("\n") == 1, err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no manifest, logs or cells: nothing started
        assert main([*argv, "--dry-run"]) == 0


def test_a_cell_finished_on_a_store_rebuilt_since_stops_the_grid_before_anything_starts(tmp_path, capsys):
    """A rerun whose finished cell recorded another store than the one at its path now stops with one line
    naming the cell, the input and what to do, before any manifest, head or cell; cells finished before
    cells recorded their inputs are reused, said once."""
    from dist_nce.cli.mini_paper import Runner, main
    from dist_nce.minipaper.cells import cell_inputs, record_inputs

    store = tmp_path / "kb"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"created_utc": "1"}))
    config = ROOT / "configs" / "mini_paper" / "tiny_cpu.yaml"
    sets = ["aida.seeds=[0]", f"aida.set=[data.prepared_dir={store}, run.progress=false]"]
    cells = planned_cells(load_config(MiniPaperConfig, config, sets), ["aida"])
    out = tmp_path / "out"
    _finish(cells, out)  # summaries without inputs: finished before the grid recorded them
    for name in ("aida-dual-hard-s0", "aida-dual-mixed50-s0"):
        record_inputs(cells[name].dir(out, ROOT), cell_inputs(cells[name], out, ROOT))
    logged: list[str] = []
    runner = Runner(out, {}, 1, logged.append)
    assert set(runner.reusable(cells)) == set(runner.reusable(cells)) == set(cells)
    assert len(logged) == 1 and "aida-dual-random-s0" in logged[0] and "reused unchecked" in logged[0], logged

    (store / "manifest.json").write_text(json.dumps({"created_utc": "2"}))  # prepared again, in place
    argv = ["--config", str(config), "--out", str(out), "--only", "aida", *(a for s in sets for a in ("--set", s))]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cell aida-dual-hard-s0 finished on other inputs: data.prepared_dir changed"), err
    assert "(and 1 more cells: aida-dual-mixed50-s0)" in err and "another --out" in err and err.count("\n") == 1
    assert not (out / "manifest.json").exists() and not (out / "logs").exists()
