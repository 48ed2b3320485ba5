"""A rerun whose checkpoints Ray Train's snapshot does not record (worker.launch.recover_unrecorded): cut off
by a kill, or never written (stopped between a worker's copy and the controller's first record). It resumes
from the newest whole checkpoint directory (worker.checkpoint.incomplete tells whole from cut), a cut
snapshot kept aside; a readable snapshot, no whole checkpoint without one, or a remote storage is left to Ray."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_nce.worker import checkpoint
from dist_nce.worker.engine import build_engine, load_deepspeed_config
from dist_nce.worker.launch import SNAPSHOT, recover_unrecorded, resume_point

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
    model = write(engine, tmp_path, "checkpoint_e", 3)
    next((model / checkpoint.DS_DIR).rglob("mp_rank_00_model_states.pt")).unlink()
    assert "no model states" in checkpoint.incomplete(model)


def test_incomplete_wants_every_ranks_zero_partition(engine, tmp_path):
    """A two-worker plan's checkpoint that holds rank 0's ZeRO partition only (rank 1's copy was not
    made): every file there is whole and both RNG files are, but it cannot be resumed."""
    two = {**PLAN, "num_workers": 2}
    d = tmp_path / "step_00000003"
    for rank in (0, 1):  # this one-process engine writes rank 0's partition both times
        checkpoint.save(engine, d, checkpoint.WorkerState(step=3), rank=rank, plan=two)
    partitions = sorted(p.name for p in (d / checkpoint.DS_DIR).rglob("*zero_pp_rank_*"))
    assert partitions == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert checkpoint.incomplete(d).endswith("no zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (d / checkpoint.DS_DIR / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(
        (d / checkpoint.DS_DIR / "step3" / partitions[0]).read_bytes())
    assert checkpoint.incomplete(d) is None


def test_a_cut_snapshot_resumes_from_the_newest_whole_checkpoint(engine, tmp_path):
    run = tmp_path / "storage" / "run"
    old = write(engine, run, "step_00000002", 2)
    write(engine, run, "step_00000004_end_ab12", 4)
    newest = write(engine, run, "step_00000006", 6)
    cut(next((newest / checkpoint.DS_DIR).rglob("*.pt")))  # the copy the kill interrupted
    (run / SNAPSHOT).write_text("")
    said = []
    got = recover_unrecorded(str(tmp_path / "storage"), "run", said.append)
    assert got == str(run / "step_00000004_end_ab12")
    assert not (run / SNAPSHOT).exists() and (run / (SNAPSHOT + ".cut")).read_text() == ""
    assert any("not resumable" in s and newest.name in s for s in said)
    assert any("step 4" in s for s in said)
    # nothing to recover: a readable snapshot (Ray resumes from it), none, a remote storage
    (run / SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": None}))
    assert recover_unrecorded(str(tmp_path / "storage"), "run") is None
    assert (run / SNAPSHOT).exists()
    assert recover_unrecorded(str(tmp_path / "storage"), "another") is None
    assert recover_unrecorded("s3://bucket/runs", "run") is None
    assert old.exists()


def test_a_cut_snapshot_without_a_whole_checkpoint_is_an_error_not_a_restart(engine, tmp_path):
    run = tmp_path / "run"
    only = write(engine, run, "checkpoint_x", 2)
    (only / checkpoint.STATE_FILE).write_text('{"step": ')
    (run / SNAPSHOT).write_text('{"ray_version": "2.6')
    with pytest.raises(ValueError, match="snapshot was cut off .* no whole checkpoint is left"):
        recover_unrecorded(str(tmp_path), "run", lambda s: None)
    assert (run / SNAPSHOT).exists()  # left as it was


def test_checkpoints_written_before_the_first_record_are_resumed_not_overwritten(engine, tmp_path):
    """Stopped after a worker copied its checkpoints into the run's storage but before Ray Train's
    controller wrote its snapshot: the rerun resumed nothing and later wrote over them. Now the newest
    whole one is resumed (and the Ctrl-C message names it); the cut one is said not resumable."""
    storage = tmp_path / "storage"
    assert recover_unrecorded(str(storage), "run") is None  # no run yet: a fresh start
    run = storage / "run"
    run.mkdir(parents=True)
    assert recover_unrecorded(str(storage), "run") is None and resume_point(str(storage), "run") is None
    write(engine, run, "step_00000002", 2)
    newest = write(engine, run, "step_00000004", 4)
    cut_one = write(engine, run, "step_00000006", 6)
    (cut_one / checkpoint.rng_file(0)).unlink()
    said = []
    assert recover_unrecorded(str(storage), "run", said.append) == str(newest)
    assert said[-1] == (f"{run}: the run was stopped before Ray Train recorded a checkpoint (no {SNAPSHOT}); "
                        "resuming from the newest whole checkpoint, step_00000004 (step 4)")
    assert any("not resumable" in s and "step_00000006" in s for s in said)
    assert resume_point(str(storage), "run") == (4, newest)
    assert not (run / SNAPSHOT).exists() and not (run / (SNAPSHOT + ".cut")).exists()
    # only a cut one: the run starts over (nothing to resume), as Ray Train would
    for d in ("step_00000002", "step_00000004"):
        (run / d / checkpoint.STATE_FILE).unlink()
    assert recover_unrecorded(str(storage), "run", lambda s: None) is None
    assert resume_point(str(storage), "run") is None
    assert recover_unrecorded("s3://bucket/runs", "run") is None
