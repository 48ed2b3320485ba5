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
