"""jobs/mini_paper.py starts its Ray head only when a cell left to run needs one (``needs_ray``)."""
from __future__ import annotations

import json
from pathlib import Path

from dist_nce.cli.mini_paper import ROOT, needs_ray, planned_cells
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
