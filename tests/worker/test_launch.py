"""A rerun whose Ray Train checkpoint snapshot was cut off by a kill (worker.launch.recover_cut_snapshot):
it resumes from the newest whole checkpoint directory (worker.checkpoint.incomplete tells whole from cut),
the cut snapshot kept aside; a readable snapshot, none, or a remote storage is left to Ray."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_nce.worker import checkpoint
from dist_nce.worker.engine import build_engine, load_deepspeed_config
from dist_nce.worker.launch import SNAPSHOT, recover_cut_snapshot

DS = Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "zero2_fp32.json"
PLAN = {"num_workers": 1, "seed": 0}


@pytest.fixture(scope="module")
def engine(dist_env):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ds = load_deepspeed_config(DS, micro_batch=2, world_size=1, grad_clip=1.0)
    eng, _, _ = build_engine(model, ds, lr=1e-2, weight_decay=0.0, total_steps=4, warmup_proportion=0.0,
                             dist_init_required=True)
    return eng


def write(engine, run_dir: Path, name: str, step: int) -> Path:
    d = run_dir / name
    checkpoint.save(engine, d, checkpoint.WorkerState(step=step), rank=0, plan=PLAN,
                    tensors={"extra.safetensors": {"x": torch.arange(6.0)}})
    return d


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_incomplete_tells_a_whole_checkpoint_from_a_cut_one(engine, tmp_path):
    whole = write(engine, tmp_path, "checkpoint_a", 3)
    assert checkpoint.incomplete(whole) is None
    pt = next((whole / checkpoint.DS_DIR).rglob("*.pt"))
    broken = write(engine, tmp_path, "checkpoint_b", 3)
    cut(broken / pt.relative_to(whole))
    assert "not a whole torch.save archive" in checkpoint.incomplete(broken)
    tensors = write(engine, tmp_path, "checkpoint_c", 3)
    cut(tensors / "extra.safetensors")
    assert "cut short" in checkpoint.incomplete(tensors)
    rng = write(engine, tmp_path, "checkpoint_d", 3)
    (rng / checkpoint.rng_file(0)).unlink()
    assert "rng_rank0.json" in checkpoint.incomplete(rng)
    assert "no manifest" in checkpoint.incomplete(tmp_path / "checkpoint_missing")


def test_a_cut_snapshot_resumes_from_the_newest_whole_checkpoint(engine, tmp_path):
    run = tmp_path / "storage" / "run"
    old = write(engine, run, "step_00000002", 2)
    write(engine, run, "step_00000004_end_ab12", 4)
    newest = write(engine, run, "step_00000006", 6)
    cut(next((newest / checkpoint.DS_DIR).rglob("*.pt")))  # the copy the kill interrupted
    (run / SNAPSHOT).write_text("")
    said = []
    got = recover_cut_snapshot(str(tmp_path / "storage"), "run", said.append)
    assert got == str(run / "step_00000004_end_ab12")
    assert not (run / SNAPSHOT).exists() and (run / (SNAPSHOT + ".cut")).read_text() == ""
    assert any("not resumable" in s and newest.name in s for s in said)
    assert any("step 4" in s for s in said)
    # nothing to recover: a readable snapshot (Ray resumes from it), none, a remote storage
    (run / SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": None}))
    assert recover_cut_snapshot(str(tmp_path / "storage"), "run") is None
    assert (run / SNAPSHOT).exists()
    assert recover_cut_snapshot(str(tmp_path / "storage"), "another") is None
    assert recover_cut_snapshot("s3://bucket/runs", "run") is None
    assert old.exists()


def test_a_cut_snapshot_without_a_whole_checkpoint_is_an_error_not_a_restart(engine, tmp_path):
    run = tmp_path / "run"
    only = write(engine, run, "checkpoint_x", 2)
    (only / checkpoint.STATE_FILE).write_text('{"step": ')
    (run / SNAPSHOT).write_text('{"ray_version": "2.6')
    with pytest.raises(ValueError, match="snapshot was cut off .* no whole checkpoint is left"):
        recover_cut_snapshot(str(tmp_path), "run", lambda s: None)
    assert (run / SNAPSHOT).exists()  # left as it was
