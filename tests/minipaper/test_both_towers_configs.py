"""Issue 36's grids (configs/mini_paper/minilm_both_towers_gpu.yaml, minilm_staleness_gpu.yaml): no Table 1 cell
freezes the entity tower, every one re-encodes the KB every 10 steps while training; the base differs from the
frozen-tower grid's base in the entity tower, its refreshes and the GPU placement only (same data, steps, arms,
seeds, precision); the staleness ablation's random and hard cells are the Table 1 grid's own."""
from dataclasses import asdict
from pathlib import Path

from dist_nce.core.config import load_config
from dist_nce.index.exact import auto_chunk_rows
from dist_nce.minipaper.cells import zeshel_cells
from dist_nce.minipaper.config import MiniPaperConfig
from dist_nce.zeshel.config import ZeshelRetrieverConfig

REPO = Path(__file__).resolve().parents[2]
GRIDS = REPO / "configs" / "mini_paper"


def grid(name: str):
    cfg = load_config(MiniPaperConfig, GRIDS / name)
    return cfg, zeshel_cells(cfg, REPO)


def resolved(cell) -> ZeshelRetrieverConfig:
    """The run's config as the job loads it (the cell's overrides on its base)."""
    sets = [s.replace("<out>", "/grid") for s in cell.sets]
    return load_config(ZeshelRetrieverConfig, REPO / cell.config, sets)


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_no_table_1_cell_freezes_the_entity_tower():
    cfg, cells = grid("minilm_both_towers_gpu.yaml")
    assert cfg.seeds == [0, 1, 2] and set(cfg.zeshel.arms) == {"random", "hard", "mixed50"}
    assert set(cfg.zeshel.architectures) == {"dual", "multi8"} and len(cells) == 2 + 2 * 3 * 3
    for cell in cells.values():
        run = resolved(cell)
        assert not run.model.freeze_entity_encoder and not run.model.entity_cache, cell.name
        assert (run.refresh.mode, run.refresh.every_steps) == ("async", 10), cell.name
        assert run.run.use_gpu and run.service.num_gpus > 0, cell.name
    multi = resolved(cells["zeshel-multi8-hard-s0"])
    assert (multi.model.retriever.preset, multi.model.retriever.m) == ("multi", 8)


def test_the_base_differs_from_the_frozen_grids_in_the_entity_tower_and_the_gpu_only():
    cpu = flat(asdict(load_config(ZeshelRetrieverConfig, REPO / "configs/zeshel/retriever_minilm_cpu.yaml")))
    gpu = flat(asdict(load_config(ZeshelRetrieverConfig, REPO / "configs/zeshel/retriever_minilm_gpu.yaml")))
    differ = {k for k in cpu if cpu[k] != gpu[k]}
    # service.index.backend, zeshel.eval_backend: torch there, faiss here (none on the GPU machine); the same
    # exact sampler over the same fp32 rows draws the hard negatives in both, and every top-k search is exact
    assert differ == {"model.freeze_entity_encoder", "model.entity_cache", "refresh.mode", "refresh.every_steps",
                      "refresh.at_epoch_start", "service.num_cpus", "service.num_gpus", "service.index.backend",
                      "service.index.chunk_rows", "zeshel.eval_backend", "run.name", "run.output_dir", "run.use_gpu",
                      "run.cpus_per_worker", "run.gpus_per_worker"}, differ
    assert (cpu["service.index.backend"], gpu["service.index.backend"]) == ("flat", "torch")
    # the chunk the CPU's auto gives (on a GPU auto pads this small KB to millions of rows)
    assert (cpu["service.index.chunk_rows"], gpu["service.index.chunk_rows"]) == (0, auto_chunk_rows("cpu", 8, 128))
    assert (cpu["zeshel.eval_backend"], gpu["zeshel.eval_backend"]) == ("auto", "torch")
    assert cpu["service.index.gumbel"] == gpu["service.index.gumbel"] == "auto"
    # and the grids on top: the same common overrides, start, arms and seeds
    frozen, _ = grid("minilm_cpu.yaml")
    both, _ = grid("minilm_both_towers_gpu.yaml")
    assert (both.zeshel.set, both.zeshel.warmup, both.zeshel.arms, both.seeds) == \
        (frozen.zeshel.set, frozen.zeshel.warmup, frozen.zeshel.arms, frozen.seeds)


def test_the_staleness_ablation_shares_the_grids_cells_and_varies_the_refresh_only():
    _, table1 = grid("minilm_both_towers_gpu.yaml")
    _, ablation = grid("minilm_staleness_gpu.yaml")
    shared = [n for n in ablation if "-hard-" in n or "-random-" in n or n.endswith("-start")]
    assert len(shared) == 7
    for name in shared:  # the same directory under the same --out: run once for both
        assert ablation[name].key(REPO) == table1[name].key(REPO), name
    for seed in (0, 1, 2):
        every = resolved(ablation[f"zeshel-dual-hard_every_step-s{seed}"])
        frozen = resolved(ablation[f"zeshel-dual-hard_frozen-s{seed}"])
        hard = resolved(ablation[f"zeshel-dual-hard-s{seed}"])
        assert (every.refresh.mode, every.refresh.every_steps) == ("sync", 1)
        assert not every.model.freeze_entity_encoder
        assert frozen.model.freeze_entity_encoder and frozen.refresh.mode == "never"
        for run in (every, frozen):  # otherwise the hard cell's run
            assert (run.negatives, run.optim, run.data) == (hard.negatives, hard.optim, hard.data)


def test_every_cell_runs_without_faiss():
    """The lent GPU machine has no faiss and its carry brings none (MiniLM alone is 52.5 of the 64 MiB): a cell
    on a faiss backend (flat, ivf, hnsw) would stop at its shard's start, or in its evaluation after training.
    scripts/device_table1_both.sh runs these two grids there."""
    for name in ("minilm_both_towers_gpu.yaml", "minilm_staleness_gpu.yaml"):
        _, cells = grid(name)
        for cell in cells.values():
            run = resolved(cell)
            assert (run.service.index.backend, run.zeshel.eval_backend) == ("torch", "torch"), (name, cell.name)
