"""scripts/device_table2.py pack --grid-config (issue 36): the cells a lease carries to the GPU machine are the
grids' cells already done, never their shared starts (whose exported model the branches load: they rerun)."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/mini_paper/minilm_both_towers_gpu.yaml", "configs/mini_paper/minilm_staleness_gpu.yaml"]


def script():
    spec = importlib.util.spec_from_file_location("device_table2", REPO / "scripts" / "device_table2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cells_carried_are_the_done_ones_without_the_starts(tmp_path):
    from dist_nce.core.config import load_config
    from dist_nce.minipaper.cells import zeshel_cells
    from dist_nce.minipaper.config import MiniPaperConfig

    both = zeshel_cells(load_config(MiniPaperConfig, REPO / CONFIGS[0]), REPO)
    ablation = zeshel_cells(load_config(MiniPaperConfig, REPO / CONFIGS[1]), REPO)
    cells = {**both, **ablation}

    def finish(name, done=True):
        d = cells[name].dir(tmp_path, REPO)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"done": done}))
        return d

    finish("zeshel-dual-start")
    hard = finish("zeshel-dual-hard-s0")
    frozen = finish("zeshel-dual-hard_frozen-s1")
    finish("zeshel-multi8-random-s2", done=False)  # stopped part-way: runs again
    got = script()._done_cells(CONFIGS, tmp_path)
    assert got == sorted([hard, frozen])


def test_a_carry_must_be_ignored_and_fit_one_call_beside_the_tree(tmp_path):
    """check_room: the device call takes the files git does not ignore plus the carry, 64 MiB in all (here 3)."""
    import subprocess

    import pytest

    root = tmp_path / "repo"
    (root / "carry").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "code.py").write_bytes(b"x" * 2 ** 20)  # 1 MiB travels in every call (tracked or not)
    (root / "carry" / "w.bin").write_bytes(b"w" * (2 ** 20 // 2))
    check = script().check_room
    with pytest.raises(SystemExit, match="not git-ignored"):
        check(root / "carry", root, limit_mib=3)
    (root / ".gitignore").write_text("/carry/\n")
    size, tree = check(root / "carry", root, limit_mib=3)
    assert size == 2 ** 20 // 2 and 2 ** 20 < tree < 2 ** 20 + 100  # code.py and .gitignore
    (root / "carry" / "more.bin").write_bytes(b"m" * (2 ** 20 // 2))  # 1 + 1 MiB: past 3 less 1 spare
    with pytest.raises(SystemExit, match=r"1\.0 MiB, with the working tree's 1\.0 MiB past the 2 MiB"):
        check(root / "carry", root, limit_mib=3)


def test_carried_summaries_leave_out_what_the_cell_read(tmp_path):
    """The GPU machine reads a rebuilt stand-in MiniLM (other bytes): a carried summary keeping its record of
    the model it read would be refused there as finished on other inputs (minipaper.cells.reusable)."""
    import tarfile

    from dist_nce.minipaper.cells import INPUTS

    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "summary.json").write_text(json.dumps({"done": True, "seconds": 3, INPUTS: {"model": "abc"}}))
    (cell / "metrics.jsonl").write_text('{"step": 1}\n')
    with tarfile.open(tmp_path / "cells.tar.xz", "w:xz") as tar:
        for f in ("summary.json", "metrics.jsonl"):
            script()._add_cell_file(tar, cell / f, f"grid/cells/cell/{f}")
    with tarfile.open(tmp_path / "cells.tar.xz") as tar:
        tar.extractall(tmp_path / "there", filter="data")
    there = tmp_path / "there" / "grid" / "cells" / "cell"
    assert json.loads((there / "summary.json").read_text()) == {"done": True, "seconds": 3}
    assert (there / "metrics.jsonl").read_text() == '{"step": 1}\n'
