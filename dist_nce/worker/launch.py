"""The driver side shared by both training jobs: one TorchTrainer from a job config's ``run``
section (workers, resources, GPU or not, storage, fault tolerance, checkpoints kept)."""
from __future__ import annotations

import os
from typing import Any, Callable

from dist_nce.cluster.fit import worker_resources  # noqa: F401  (what one worker asks Ray for; re-exported)


def use_gpu(cfg: Any) -> bool:
    """``run.use_gpu``, or auto-detect: GPUs in the Ray cluster."""
    if cfg.run.use_gpu is not None:
        return cfg.run.use_gpu
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def storage_uri(path: str) -> str:
    """Ray Train wants an absolute local path (or a URI such as s3://...)."""
    return path if "://" in path else os.path.abspath(path)


SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints a rerun resumes from
RESUME_FROM = "resume_from"  # train_loop_config key: the checkpoint directory recover_unrecorded chose


def recover_unrecorded(storage_path: str, name: str, log: Callable[[str], None] = print) -> str | None:
    """The checkpoint directory a rerun of run ``name`` resumes from when Ray Train's snapshot of its
    checkpoints does not record them: cut off, or never written; None when Ray Train's own choice stands
    (a readable snapshot, no run yet, no whole checkpoint without a snapshot, or a storage that is not a
    local path).

    Why: a worker copies its checkpoint into the run's storage before the controller records it in the
    snapshot (Ray Train 2.60, ``CheckpointManager._write_state_to_storage``), and rewrites that snapshot
    in place after every checkpoint. So a Ctrl-C or a kill between the copy and the first record leaves
    whole checkpoints and no snapshot: the rerun started over from step 0 and later wrote its own
    ``step_...`` directories over them. A driver killed between the truncation and the write leaves the
    snapshot empty: the rerun's controller failed to parse it (seen in tests/jobs/test_chaos.py). Then
    the newest checkpoint directory that is whole (:func:`dist_nce.worker.checkpoint.incomplete`) is
    resumed from, by step, a cut snapshot moved aside (``<snapshot>.cut``, kept): the workers get it in
    ``train_loop_config[RESUME_FROM]`` and load it while Ray Train has no checkpoint of this rerun
    (:func:`resume_checkpoint`). A cut snapshot with no whole checkpoint is a ValueError that says so
    rather than a restart of the run from step 0 over its own storage."""
    from pathlib import Path

    snapshot_read = read_snapshot(storage_path, name)
    run_dir = Path(storage_path) / name
    if not _unrecorded(storage_path, snapshot_read, run_dir):
        return None
    snapshot = run_dir / SNAPSHOT
    found = whole_checkpoints(run_dir, log)
    if not found and snapshot_read is None:
        return None  # interrupted before any checkpoint was whole: nothing to resume, the run starts over
    if not found:
        raise ValueError(f"{snapshot}: Ray Train's checkpoint snapshot was cut off (its writer was killed) and no "
                         f"whole checkpoint is left in {run_dir}; move {run_dir} away to start run.name={name} "
                         "again from step 0, or use another run.name")
    step, _, best = max(found)
    if snapshot_read == CUT:
        snapshot.replace(snapshot.with_name(SNAPSHOT + ".cut"))
        why = f"{snapshot}: Ray Train's checkpoint snapshot was cut off (its writer was killed mid-write); kept as " \
              f"{SNAPSHOT}.cut"
    else:
        why = f"{run_dir}: the run was stopped before Ray Train recorded a checkpoint (no {SNAPSHOT})"
    log(f"{why}; resuming from the newest whole checkpoint, {best.name} (step {step})")
    return str(best)


def resume_point(storage_path: str, name: str) -> tuple[int, Any] | None:
    """(step, checkpoint directory) that a rerun of run ``name`` resumes from, chosen as Ray Train and
    :func:`recover_unrecorded` choose it: the latest checkpoint Ray Train's snapshot records (a
    checkpoint a worker wrote after it, before an abort, is not used); the newest whole checkpoint
    directory when the snapshot was cut off or never written; None when there is none (the rerun starts
    at step 0) or for a remote storage."""
    from pathlib import Path

    snapshot = read_snapshot(storage_path, name)
    run_dir = Path(storage_path) / name
    if _unrecorded(storage_path, snapshot, run_dir):
        found = whole_checkpoints(run_dir)
        if not found:
            return None
        step, _, directory = max(found)
        return step, directory
    latest = (snapshot or {}).get("latest_checkpoint_result") or {}
    step = (latest.get("metrics") or {}).get("step")
    return None if step is None else (int(step), run_dir / latest["checkpoint_dir_name"])


def check_rerun(storage_path: str, name: str, plan: Callable[[], dict[str, Any]]) -> None:
    """Refuse (ValueError naming each difference) a rerun of run ``name`` whose plan (``plan()``, a plan's
    ``as_dict()``, made only when there is a checkpoint to compare) differs from that of the checkpoint it
    would resume from (:func:`resume_point`), before any cluster work: the workers refuse it too, but each
    restart (``run.max_failures``) logs a traceback and the job ends in Ray Train's error. A remote storage
    is left to the workers."""
    from pathlib import Path

    from dist_nce.core.artifacts import read_manifest
    from dist_nce.worker.checkpoint import KIND, check_resumable

    point = resume_point(storage_path, name)
    if point is None:
        return
    try:
        manifest = read_manifest(point[1], KIND)
    except (OSError, ValueError):  # gone or unreadable: what the rerun then does is Ray Train's to say
        return
    check_resumable(manifest, plan(), str(point[1]), str(Path(storage_path) / name))


CUT = "cut"  # read_snapshot: the snapshot is there but does not parse


def _unrecorded(storage_path: str, snapshot: dict[str, Any] | str | None, run_dir: Any) -> bool:
    """Ray Train's snapshot (:func:`read_snapshot`) leaves the run's checkpoints unrecorded: cut off, or
    absent from a local run directory that exists."""
    return snapshot == CUT or (snapshot is None and "://" not in storage_path and run_dir.is_dir())


def read_snapshot(storage_path: str, name: str) -> dict[str, Any] | str | None:
    """Ray Train's checkpoint snapshot of run ``name`` as a dict, :data:`CUT` where it does not parse (or is
    not a JSON object),
    None where there is none (or the storage is not a local path)."""
    import json
    from pathlib import Path

    snapshot = Path(storage_path) / name / SNAPSHOT
    if "://" in storage_path or not snapshot.is_file():
        return None
    try:
        parsed = json.loads(snapshot.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return CUT
    return parsed if isinstance(parsed, dict) else CUT  # e.g. "[]": Ray Train cannot resume from it either


def whole_checkpoints(run_dir: Any, log: Callable[[str], None] = lambda s: None) -> list[tuple[int, str, Any]]:
    """(step, name, directory) of every checkpoint directory in ``run_dir`` that can be resumed from
    (:func:`dist_nce.worker.checkpoint.incomplete`); the others are logged with the reason."""
    from pathlib import Path

    from dist_nce.core.artifacts import read_manifest
    from dist_nce.worker.checkpoint import KIND, incomplete

    found = []
    for d in sorted(p for p in Path(run_dir).iterdir() if p.is_dir()):  # the workers name them (step_00000016_...)
        why = incomplete(d)
        if why is None:
            found.append((int(read_manifest(d, KIND)["step"]), d.name, d))
        else:
            log(f"{d}: not resumable ({why})")
    return found


STEP_DIR = r"step_(\d{8,})(?:_end_[0-9a-f]{8})?"  # the names our workers give (WorkerScaffold.save_checkpoint)


def remove_aborted_writes(storage_path: str, name: str, log: Callable[[str], None] = print) -> list[Any]:
    """Remove (and log, one line each) the checkpoint directories of run ``name`` that Ray Train's readable
    snapshot does not record and whose step is after that of the latest one it records; the directories
    removed. Nothing for a snapshot cut off or absent (:func:`recover_unrecorded`'s), or a remote storage.

    Why: Ray Train 2.60's SIGINT handler aborts the controller, which gives the workers ~5 s before killing
    them, and they train on meanwhile: a Ctrl-C at step 39 left ``step_00000060``, copied into the run's
    storage and never recorded. The rerun resumes from the snapshot's latest checkpoint (:func:`resume_point`)
    and replays those steps exactly, so such a directory is never read again: it only held a checkpoint of
    disk per Ctrl-C beside the ``run.num_to_keep`` recorded ones until the rerun wrote the same step over it.
    Only directories of ours (:func:`_ours`) named as our workers name them (:data:`STEP_DIR`); a rerun holds
    the run's lock while this runs, so no live run writes there."""
    import shutil
    from pathlib import Path

    snapshot = read_snapshot(storage_path, name)
    point = resume_point(storage_path, name) if isinstance(snapshot, dict) else None
    if point is None:  # no readable snapshot, or one that records no checkpoint: nothing is "after"
        return []
    latest, removed = point[0], []
    for d, step in _aborted_writes(Path(storage_path) / name, _strings(snapshot), latest):
        try:
            shutil.rmtree(d)
        except OSError as exc:  # left as it was: the rerun writes the same step over it, as before
            log(f"{d}: not removed ({exc})")
            continue
        log(f"{d}: removed; step {step} was written by the workers after the run was aborted and never recorded "
            f"in {SNAPSHOT}; the rerun resumes at step {latest} and replays those steps exactly")
        removed.append(d)
    return removed


def _aborted_writes(run_dir: Any, recorded: set[str], latest: int) -> list[tuple[Any, int]]:
    """(directory, step) of each checkpoint directory of ours in ``run_dir`` that is not among the names
    ``recorded`` and whose step (in its name) is after ``latest``."""
    import re

    found = []
    for d in sorted(run_dir.iterdir()):
        m = re.fullmatch(STEP_DIR, d.name)
        if m and int(m[1]) > latest and d.name not in recorded and not d.is_symlink() and d.is_dir() and _ours(d):
            found.append((d, int(m[1])))
    return found


def _ours(directory: Any) -> bool:
    """A checkpoint directory our workers wrote, whole or not: our manifest (kind
    :data:`dist_nce.worker.checkpoint.KIND`); without a readable one (Ray Train copies a checkpoint file by
    file, each rank its own, so an abort can leave any part, the manifest included, absent or cut), nothing but
    the files and folder :func:`dist_nce.worker.checkpoint.save` writes (none at all when the copy had only
    made the directory). A manifest of another kind, or anything else in it, is not ours: kept."""
    import re

    from dist_nce.core.artifacts import MANIFEST, read_manifest
    from dist_nce.worker.checkpoint import DS_DIR, KIND, STATE_FILE

    try:
        manifest = read_manifest(directory)
        return isinstance(manifest, dict) and manifest.get("kind") == KIND
    except ValueError:  # no manifest, or cut short: judged by what the directory holds
        pass
    except OSError:
        return False
    try:
        return all(p.name in (MANIFEST, STATE_FILE, DS_DIR) or re.fullmatch(r"rng_rank\d+\.json", p.name)
                   or p.name.endswith(".safetensors") for p in directory.iterdir())
    except OSError:
        return False


def _strings(value: Any) -> set[str]:
    """Every string in a JSON value. What Ray Train's snapshot records: 2.60 names checkpoint directories in
    ``checkpoint_results``, ``latest_checkpoint_result`` and ``pending_training_results`` (each a
    ``checkpoint_dir_name``) and in its ``*_checkpoint_dir_names`` lists; taking every string keeps any name
    it records, wherever a later schema puts it."""
    if isinstance(value, dict):
        return set().union(*map(_strings, value.values()))
    if isinstance(value, list):
        return set().union(*map(_strings, value))
    return {value} if isinstance(value, str) else set()


def resume_checkpoint(loop_config: dict[str, Any]) -> Callable[[], Any]:
    """A worker's ``get_checkpoint``: Ray Train's latest checkpoint of this run, else the directory
    :func:`recover_unrecorded` chose (``loop_config[RESUME_FROM]``), else None."""
    import ray.train

    fallback = loop_config.get(RESUME_FROM)

    def get() -> Any:
        got = ray.train.get_checkpoint()
        if got is None and fallback:
            return ray.train.Checkpoint.from_directory(fallback)
        return got

    return get


def fit_and_release(trainer):
    """``trainer.fit()``; then the SIGINT handler that Ray Train put in place is the one before it again.

    Called in the main thread, Ray Train 2.60's ``fit`` installs a SIGINT handler (Ctrl-C aborts the run)
    that holds the run's TrainController actor, and leaves it installed: the controller and the
    DatasetManager it holds, two processes, stayed alive until the next ``fit`` replaced the handler or
    the driver exited (seen in every test process that trained in-process, idling the rest of the suite;
    a notebook that trains keeps them too). Ctrl-C during ``fit`` still aborts the run.
    """
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    try:
        return trainer.fit()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def make_torch_trainer(train_func: Callable[[dict[str, Any]], None], cfg: Any, loop_config: dict[str, Any]):
    """A TorchTrainer running ``train_func`` on ``run.num_workers`` workers; gloo on CPUs, NCCL on GPUs;
    the group meets without a network listener when all workers are on this machine."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dist_nce.worker.process_group import LocalGroupTorchConfig

    run, gpu = cfg.run, use_gpu(cfg)
    remove_aborted_writes(storage_uri(run.storage_path), run.name)  # what a Ctrl-C's workers left unrecorded
    recovered = recover_unrecorded(storage_uri(run.storage_path), run.name)
    if recovered is not None:  # Ray Train 2.60 refuses resume_from_checkpoint: the workers get it themselves
        loop_config = {**loop_config, RESUME_FROM: recovered}
    return TorchTrainer(
        train_func,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=run.num_workers, use_gpu=gpu,
                                     resources_per_worker=worker_resources(run, gpu)),
        torch_config=LocalGroupTorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=RunConfig(name=run.name, storage_path=storage_uri(run.storage_path),
                             failure_config=FailureConfig(max_failures=run.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=run.num_to_keep)),
    )
