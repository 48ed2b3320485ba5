"""A rerun whose checkpoints Ray Train's snapshot does not record (worker.launch.recover_unrecorded): cut off
by a kill, or never written (stopped between a worker's copy and the controller's first record). It resumes
from the newest whole checkpoint directory (worker.checkpoint.incomplete tells whole from cut), a cut
snapshot kept aside; a readable snapshot, no whole checkpoint without one, or a remote storage is left to Ray.
A readable snapshot's run (worker.launch.remove_aborted_writes): the checkpoint directories a Ctrl-C's workers
wrote after its latest checkpoint, never recorded, are removed before the rerun's trainer starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_nce.worker import checkpoint
from dist_nce.worker.engine import build_engine, load_deepspeed_config
from dist_nce.core.artifacts import write_manifest
from dist_nce.worker.launch import SNAPSHOT, recover_unrecorded, remove_aborted_writes, resume_point

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
    for text in ("[]", "null"):  # JSON, but no snapshot: cut as well (resume_point raised AttributeError)
        (run / SNAPSHOT).write_text(text)
        assert resume_point(str(tmp_path / "storage"), "run")[0] == 4
        assert recover_unrecorded(str(tmp_path / "storage"), "run", said.append) == str(run / "step_00000004_end_ab12")
        assert (run / (SNAPSHOT + ".cut")).read_text() == text
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


def ray_snapshot(kept: list[tuple[str, int]], pending: list[tuple[str, int]] = (), validated: list[str] = ()) -> str:
    """Ray Train 2.60's checkpoint_manager_snapshot.json (``_CheckpointManagerState.json()``) recording the
    checkpoint directories ``kept`` (name, step; the last one the latest) and ``pending``."""
    def result(name, step):
        return {"version": 0, "checkpoint_dir_name": name, "metrics": {"step": step, "loss": 0.5}}

    return json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": [result(*k) for k in kept],
        "checkpoint_report_indices": list(range(len(kept))), "latest_checkpoint_result": result(*kept[-1]),
        "pending_training_results": [result(*p) for p in pending], "pending_validation_specs": [False] * len(pending),
        "current_report_index": len(kept) + len(pending), "validated_checkpoint_dir_names": list(validated),
        "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []})


def aborted_run(engine, run: Path) -> dict[str, Path]:
    """A run directory as a Ctrl-C leaves it: Ray Train's snapshot records step_00000016 and step_00000032
    (the latest), and the workers wrote more before the abort reached them, some whole, some cut."""
    d = {n: write(engine, run, n, int(n[5:13])) for n in (
        "step_00000008",  # before the latest, unrecorded (Ray Train's deletion was interrupted): not ours to judge
        "step_00000016", "step_00000032",  # recorded
        "step_00000040", "step_00000044",  # after the latest but recorded: pending a report, validated
        "step_00000048", "step_00000080_end_0123abcd")}  # after the latest, whole, never recorded
    cut_copy = write(engine, run, "step_00000064", 64)  # the copy the abort cut: no manifest, no train state yet
    (cut_copy / "manifest.json").unlink()
    (cut_copy / checkpoint.STATE_FILE).unlink()
    cut(next((cut_copy / checkpoint.DS_DIR).rglob("*.pt")))
    manifest_cut = write(engine, run, "step_00000072", 72)
    cut(manifest_cut / "manifest.json")
    (run / "step_00000096").mkdir()  # the copy had only made the directory
    # not ours, though after the latest: another kind of manifest, a file our checkpoints never hold, a name
    # our workers never give (Ray Train's own default), a file, a link
    other = run / "step_00000050"
    other.mkdir()
    write_manifest(other, "kb_snapshot", 1, step=50)
    (run / "step_00000052").mkdir()
    (run / "step_00000052" / "notes.txt").write_text("mine")
    (run / "checkpoint_2026-01-01_00-00-00.000000").mkdir()
    (run / "step_00000056").write_text("a file")
    (run / "step_00000058").symlink_to(d["step_00000048"], target_is_directory=True)
    (run / SNAPSHOT).write_text(ray_snapshot([("step_00000016", 16), ("step_00000032", 32)],
                                             pending=[("step_00000040", 40)], validated=["step_00000044"]))
    return {**d, "step_00000064": cut_copy, "step_00000072": manifest_cut}


AFTER_THE_LATEST = ["step_00000048", "step_00000064", "step_00000072", "step_00000080_end_0123abcd",
                    "step_00000096"]


def test_checkpoints_the_workers_wrote_after_an_abort_are_removed_by_the_rerun(engine, tmp_path):
    """Ctrl-C: Ray Train's controller aborts, the workers train on ~5 s and write checkpoints its snapshot never
    records. The rerun resumes from the latest one recorded and replays those steps, so their directories
    (one checkpoint of disk per Ctrl-C) go, each said, before its trainer starts; nothing else does."""
    storage, run = tmp_path / "storage", tmp_path / "storage" / "run"
    aborted_run(engine, run)
    before = sorted(p.name for p in run.iterdir())
    said = []
    removed = remove_aborted_writes(str(storage), "run", said.append)
    assert sorted(p.name for p in removed) == AFTER_THE_LATEST
    assert sorted(p.name for p in run.iterdir()) == sorted(set(before) - set(AFTER_THE_LATEST))
    assert len(said) == len(AFTER_THE_LATEST)
    for name, line in zip(AFTER_THE_LATEST, said):
        assert line.startswith(f"{run / name}: removed; step {int(name[5:13])} was written by the workers after "
                               f"the run was aborted and never recorded in {SNAPSHOT}"), line
        assert line.endswith("the rerun resumes at step 32 and replays those steps exactly")
    assert resume_point(str(storage), "run") == (32, run / "step_00000032")
    assert checkpoint.incomplete(run / "step_00000032") is None  # what the rerun resumes from is left whole
    assert (run / "step_00000050" / "manifest.json").exists() and (run / "step_00000052" / "notes.txt").exists()
    assert remove_aborted_writes(str(storage), "run", said.append) == [] and len(said) == len(AFTER_THE_LATEST)


def test_a_cut_or_absent_snapshot_or_a_remote_storage_removes_nothing(engine, tmp_path):
    """Without a readable snapshot nothing tells which directories Ray Train recorded: those runs are
    recover_unrecorded's (it resumes from the newest whole one). A snapshot recording no checkpoint has no
    latest step to be after; a remote storage is not walked."""
    storage, run = tmp_path / "storage", tmp_path / "storage" / "run"
    aborted_run(engine, run)
    snapshot = (run / SNAPSHOT).read_text()
    before = sorted(p.name for p in run.iterdir() if p.name != SNAPSHOT)
    for text in ("", snapshot[: len(snapshot) // 2], None, json.dumps({"latest_checkpoint_result": None}), "[]"):
        if text is None:
            (run / SNAPSHOT).unlink()
        else:
            (run / SNAPSHOT).write_text(text)
        assert remove_aborted_writes(str(storage), "run", pytest.fail) == [], text
        assert sorted(p.name for p in run.iterdir() if p.name != SNAPSHOT) == before, text
    (run / SNAPSHOT).write_text(snapshot)
    assert remove_aborted_writes("s3://bucket/storage", "run", pytest.fail) == []
    assert remove_aborted_writes(str(storage), "another", pytest.fail) == []
    assert sorted(p.name for p in run.iterdir() if p.name != SNAPSHOT) == before


def test_the_trainer_is_made_after_the_aborted_writes_are_removed(engine, tmp_path, monkeypatch):
    """make_torch_trainer (both jobs' trainer) removes them before the TorchTrainer exists."""
    from types import SimpleNamespace

    import ray.train.torch

    from dist_nce.worker.launch import make_torch_trainer

    storage, run = tmp_path / "storage", tmp_path / "storage" / "run"
    aborted_run(engine, run)
    seen = []
    monkeypatch.setattr(ray.train.torch, "TorchTrainer",
                        lambda *a, **kw: seen.append(sorted(p.name for p in run.iterdir())) or "trainer")
    cfg = SimpleNamespace(run=SimpleNamespace(
        storage_path=str(storage), name="run", num_workers=1, use_gpu=False, cpus_per_worker=1, gpus_per_worker=0,
        resources_per_worker={}, max_failures=0, num_to_keep=2))
    assert make_torch_trainer(lambda config: None, cfg, {}) == "trainer"
    assert seen and not set(AFTER_THE_LATEST) & set(seen[0]) and "step_00000032" in seen[0]
