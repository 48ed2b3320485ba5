"""configs/aida/*.yaml load, say what they claim, and their inputs are checked up front."""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from dist_nce.core.config import ConfigError, load_config
from dist_nce.train.config import PATH_FIELDS, TrainJobConfig, check_inputs, with_absolute_paths
from dist_nce.train.plan import sampling

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(glob.glob(str(REPO / "configs" / "aida" / "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: Path(p).name)
def test_every_config_loads(path):
    cfg = load_config(TrainJobConfig, path)
    assert (REPO / cfg.deepspeed.config).is_file()
    assert cfg.optim.batch_size % cfg.run.num_workers == 0


def test_paper_grid():
    grid = set()
    for path in glob.glob(str(REPO / "configs" / "aida" / "paper_*.yaml")):
        cfg = load_config(TrainJobConfig, path)
        r, n = cfg.model.retriever, cfg.negatives
        grid.add((r.preset, r.m, n.p))
        assert Path(path).stem == f"paper_{r.preset}{r.m or ''}_p{n.p:g}"
        assert (n.num_candidates, cfg.optim.batch_size, cfg.optim.epochs) == (64, 4, 4)
        assert cfg.optim.lr in (5e-5, 2e-5, 1e-5) and cfg.model.blink_checkpoint.endswith("biencoder_wiki_large.bin")
        assert (cfg.data.mention_max_len, cfg.data.entity_max_len) == (32, 128)
        assert cfg.run.use_gpu and cfg.service.num_gpus > 0
        assert (n.schedule, cfg.refresh.mode, cfg.refresh.at_epoch_start) == ("per_epoch", "sync", True)
        s = sampling(n.mode, n.p, n.num_candidates)
        assert (s.n_hard, s.n_random) == ((32, 31) if n.p == 50 else (0, 63))
    assert grid == {(p, m, q) for p, m in (("dual", None), ("multi", 2), ("multi", 3)) for q in (0.0, 50.0)}


def test_the_kuberay_job_overrides_are_valid():
    text = (REPO / "configs" / "cluster" / "kuberay" / "rayjob.yaml").read_text()
    config = re.search(r"--config (\S+)", text).group(1)
    sets = re.findall(r"--set (\S+)", text)
    assert config == "configs/aida/paper_dual_p50.yaml" and sets
    cfg = load_config(TrainJobConfig, REPO / config, sets)
    assert cfg.run.storage_path == "/mnt/shared/ray_results"


def test_check_inputs_names_every_missing_input(tmp_path):
    cfg = load_config(TrainJobConfig, REPO / "configs" / "aida" / "tiny_cpu.yaml", [
        f"data.prepared_dir={tmp_path / 'kb'}", "data.synthetic_entities=0", f"model.init_from={tmp_path / 'm'}",
        f"deepspeed.config={tmp_path / 'ds.json'}"])
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    for key in ("model.init_from: directory not found", "deepspeed.config: file not found", "data.prepared_dir:"):
        assert key in str(e.value)
    (tmp_path / "ds.json").write_text('{"train_batch_size": 3}')
    with pytest.raises(ConfigError, match="train_batch_size=3"):
        check_inputs(cfg)


def test_paths_resolve_against_the_driver_directory(tmp_path):
    cfg = load_config(TrainJobConfig, REPO / "configs" / "aida" / "tiny_cpu.yaml", ["run.storage_path=s3://b/r"])
    out = with_absolute_paths(cfg, str(tmp_path))
    assert out.data.prepared_dir == str(tmp_path / "data" / "prepared" / "tiny_cpu")
    assert out.run.storage_path == "s3://b/r" and out.model.retriever.mention_model is None
    assert cfg.data.prepared_dir == "data/prepared/tiny_cpu"  # the original is untouched
    for dotted in PATH_FIELDS:  # every listed field exists
        obj = out
        for part in dotted.split("."):
            obj = getattr(obj, part)
