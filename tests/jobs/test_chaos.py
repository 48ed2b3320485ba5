"""Chaos during one whole run of ``python jobs/aida_finetune.py``, as a user runs it.

One run of the command (a subprocess in its own session, starting its own local loopback Ray)
has, in this order, SIGKILLed:

a. a shard process DURING a refresh: found through the Ray state API of the job's own
   cluster (an ``EntityShard.refresh`` task in state RUNNING; its ``worker_pid``), and shown
   to have been hit mid-refresh afterwards (that attempt ended FAILED, not FINISHED, and a new
   shard process took its place);
b. a Ray Train worker during training (Ray Train restarts the group from a checkpoint);
c. the driver itself: then no process of the job may be left (its session, its Ray temp dir)
   within 30 s. Ray alone left the raylet's two agents running for 60 s; dist_nce/cluster/reaper.py
   (started by init_ray) ends them.

The same command is then run again: it resumes from the newest checkpoint Ray Train had
registered (those written in the last moments before the driver died are not) and ends with the
losses of every step and the dev metrics of an undisturbed run of the same command (a fresh
run directory), to rtol 1e-5.

Deterministic settings (as tests/train/test_train_ray.py): synchronous refresh at epoch starts,
checkpoints every 3 steps. ``service.encode_batch_size=1`` makes a refresh last long enough to
be caught RUNNING, and the job's Ray reports task events every 100 ms instead of 1 s (env
``RAY_task_events_report_interval_ms``, observability only).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.tinyrun import TEST_CONFIG, prepare_tiny, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/aida_finetune.py"
SETTINGS = ["refresh.mode=sync", "refresh.every_steps=0", "run.checkpoint_every_steps=3", "run.max_failures=2",
            "run.evaluate_before=false", "run.export=false", "service.encode_batch_size=1"]
TOTAL_STEPS = 24  # configs/aida/test_tiny.yaml: 6 epochs x 4 steps
STEPS_PER_EPOCH, CHECKPOINT_EVERY = 4, 3  # the same config; SETTINGS
RUN_TIMEOUT = 900  # seconds for one run of the job on a loaded 2-core machine
ORPHAN_GRACE = 30  # seconds within which every process of a killed driver must be gone


def checkpointed(done: int) -> bool:
    """Whether the trainer saves a checkpoint once ``done`` steps are done (WorkerScaffold.checkpoint_due:
    every run.checkpoint_every_steps and at every epoch's end)."""
    return done % CHECKPOINT_EVERY == 0 or done % STEPS_PER_EPOCH == 0


# ---------------------------------------------------------------------------- processes

def proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, pgrp, session, ...), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def holds_file_in(pid: int, prefix: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def scratch_of(pids) -> list[str]:
    """What ``pids`` made in the temp directory through dist_nce.core.scratch (checkpoint staging
    directories, process-group store files) and is still there."""
    from dist_nce.core.scratch import scratch_name
    from dist_nce.worker.process_group import STORE_PREFIX
    from dist_nce.worker.scaffold import WorkerScaffold

    starts = tuple(scratch_name(prefix, pid) for prefix in (WorkerScaffold.ckpt_prefix, STORE_PREFIX) for pid in pids)
    return sorted(name for name in os.listdir(tempfile.gettempdir()) if name.startswith(starts))


def processes_of(session: int, temp_dir: str) -> dict[int, bytes]:
    """Every process of a job: in its session (field 6 of stat), naming its Ray temp dir on
    its command line, or a ``ray::`` process holding a file inside that temp dir."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat, cmd = proc_stat(pid), cmdline(pid)
        if stat is None:
            continue
        if int(stat[3]) == session or temp_dir.encode() in cmd or (
                cmd.startswith(b"ray::") and holds_file_in(pid, temp_dir + "/")):
            found[pid] = cmd.split(b"\0")[0][:80]
    return found


def titled(session: int, title: bytes) -> list[int]:
    """Pids in ``session`` whose process title starts with ``title`` (e.g. b"ray::EntityShard")."""
    return sorted(int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
                  and (stat := proc_stat(int(e.name))) and int(stat[3]) == session
                  and cmdline(int(e.name)).startswith(title))


# ---------------------------------------------------------------------------- the job

class Job:
    """``python jobs/aida_finetune.py ARGS`` in a session of its own, with its own Ray temp dir,
    stdout and stderr to ``log``."""

    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self.temp_dir = tempfile.mkdtemp(prefix="chaos_", dir="/tmp")  # short: Ray's socket paths
        # Unbuffered, as on a terminal: what the driver printed is in the log when it is killed.
        env = {**os.environ, "RAY_TMPDIR": self.temp_dir, "RAY_task_events_report_interval_ms": "100",
               "PYTHONUNBUFFERED": "1"}
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed by finish/kill)
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, JOB, *args], cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_for(self, what: str, condition, timeout: float = RUN_TIMEOUT, poll: float = 0.1):
        """condition()'s first truthy value; fails if the job exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"the job exited ({self.proc.returncode}) while waiting for {what}:\n"
                            + self.output[-3000:])
            time.sleep(poll)
        pytest.fail(f"timed out waiting for {what}:\n" + self.output[-3000:])

    def dashboard(self) -> str:
        """The job's own Ray dashboard (it serves the state API), from ray.init's message."""
        return self.wait_for("the job's Ray to start", lambda: (m := re.search(
            r"View the dashboard at \S*(http://127\.0\.0\.1:\d+)", self.output)) and m.group(1), timeout=300)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def remove_temp_dir(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def train_losses(metrics: Path) -> list[tuple[int, float]]:
    """Every (step, loss) line of metrics.jsonl in order, re-trained steps included."""
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "train/loss" in d:
            out.append((int(d["step"]), float(d["train/loss"])))
    return out


def latest_checkpoint(storage: Path) -> int | None:
    """The step of the newest checkpoint Ray Train registered (the one a rerun resumes from).
    Directories of checkpoints written but not yet registered when the driver died do not count.
    A driver killed while Ray rewrote its snapshot leaves it empty: the rerun then resumes from the
    newest whole checkpoint directory (worker.launch.recover_unrecorded), which this finds alike."""
    from dist_nce.worker.launch import whole_checkpoints

    snapshots = list(storage.glob("*/checkpoint_manager_snapshot.json"))
    assert len(snapshots) == 1, snapshots
    try:
        latest = json.loads(snapshots[0].read_text()).get("latest_checkpoint_result")
    except json.JSONDecodeError:
        return max((step for step, _, _ in whole_checkpoints(snapshots[0].parent)), default=None)
    return latest["metrics"]["step"] if latest else None


# ---------------------------------------------------------------------------- the state API

WATCH_TASKS = r"""
import json, sys, time
from ray.util.state import list_tasks

address, name = sys.argv[1], sys.argv[2]
seen = set()
while True:
    try:
        tasks = list_tasks(address=address, filters=[("func_or_class_name", "=", name)], limit=10000,
                           raise_on_missing_output=False, timeout=10)
    except Exception as e:  # the dashboard is starting, or the cluster is gone
        print(json.dumps({"error": repr(e)[:200]}), flush=True)
        time.sleep(0.5)
        continue
    for t in tasks:
        key = (t.task_id, t.attempt_number, t.state)
        if key not in seen:
            seen.add(key)
            print(json.dumps({"task": t.task_id, "attempt": t.attempt_number, "state": t.state,
                              "pid": t.worker_pid, "error": t.error_type, "time": time.time()}), flush=True)
    time.sleep(0.05)
"""


class TaskWatcher:
    """Streams the state changes of one remote function's tasks on the job's cluster.

    A separate process (Ray's state API client reads RAY_AUTH_MODE once per process; the job's
    ray.init created ~/.ray/auth_token), so this pytest process never touches Ray's config."""

    def __init__(self, address: str, name: str):
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-c", WATCH_TASKS, address, name], cwd=REPO,
                                     env={**os.environ, "RAY_AUTH_MODE": "token"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            event = json.loads(line)
            if "task" in event:
                with self.lock:
                    self.events.append(event)

    def states(self) -> dict[tuple[str, int], dict]:
        """Latest event of every (task, attempt)."""
        with self.lock:
            latest = {}
            for e in self.events:
                latest[(e["task"], e["attempt"])] = e
            return latest

    def stop(self):
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("chaos_kb")
    prepare_tiny(root, tiny_model_dir)
    return root


def command(kb: Path, model_dir: str, run_dir: Path) -> list[str]:
    sets = [*tiny_overrides(kb, model_dir), f"run.output_dir={run_dir / 'out'}",
            f"run.storage_path={run_dir / 'ray'}", *SETTINGS]
    return ["--config", str(TEST_CONFIG.relative_to(REPO))] + [a for s in sets for a in ("--set", s)]


def wait_until_gone(session: int, temp_dir: str, timeout: float = ORPHAN_GRACE) -> tuple[dict[int, bytes], float]:
    start = time.monotonic()
    while (left := processes_of(session, temp_dir)) and time.monotonic() - start < timeout:
        time.sleep(0.25)
    return left, time.monotonic() - start


def kill_shard_during_refresh(job: Job, watcher: TaskWatcher, metrics: Path, record: dict, tries: int = 3):
    """SIGKILL the process of an EntityShard.refresh task seen RUNNING (after epoch 1 began, so a
    training-time refresh); retry at the next epoch's refresh if the refresh had finished before
    the signal landed. Records the hit."""
    session = job.proc.pid
    job.wait_for("step 4", lambda: len(train_losses(metrics)) >= 5)
    misses = []
    for _ in range(tries):
        before = set(watcher.states())

        def running(before=before):
            for key, e in watcher.states().items():
                if key not in before and e["state"] == "RUNNING" and e["pid"]:
                    return key, e
            return None

        (task, attempt), event = job.wait_for("a running EntityShard.refresh", running, poll=0.02)
        victim = event["pid"]
        assert cmdline(victim).startswith(b"ray::EntityShard"), cmdline(victim)
        assert int(proc_stat(victim)[3]) == session, "the shard is not the job's"
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic() - job.started
        # That attempt must end FAILED (killed mid-refresh); FINISHED means it was done already.
        def ended(key=(task, attempt)):
            e = watcher.states().get(key)
            return e if e and e["state"] in ("FAILED", "FINISHED") else None

        fate = job.wait_for("the killed refresh attempt's fate", ended, timeout=120)
        if fate["state"] == "FAILED":
            record["shard"] = {"pid": victim, "task": task, "attempt": attempt, "error": fate["error"],
                               "at_s": round(killed_at, 1), "steps_logged": len(train_losses(metrics)),
                               "misses": misses}
            return
        misses.append({"pid": victim, "at_s": round(killed_at, 1)})
    pytest.fail(f"{tries} shard kills all landed after their refresh had finished: {misses}")


# ---------------------------------------------------------------------------- the chaos run

@pytest.fixture(scope="module")
def undisturbed_job(kb, tiny_model_dir, tmp_path_factory):
    """The undisturbed run of the same command, started before the chaos run so that the two overlap
    (one job's start-up and waits are the other's compute; each has its own session, Ray and temp
    dir, and every kill below picks its victim inside the chaos job's session). ``undisturbed``
    waits for it."""
    run_dir = tmp_path_factory.mktemp("undisturbed")
    job = Job(command(kb, tiny_model_dir, run_dir), run_dir / "run.log")
    try:
        yield job, run_dir
    finally:
        job.kill()
        job.remove_temp_dir()


@pytest.fixture(scope="module")
def chaos(undisturbed_job, kb, tiny_model_dir, tmp_path_factory):
    """One run with the three kills, then the same command again. Returns what happened."""
    run_dir = tmp_path_factory.mktemp("chaos_run")
    args = command(kb, tiny_model_dir, run_dir)
    metrics, storage = run_dir / "out" / "metrics.jsonl", run_dir / "ray"
    record: dict = {}
    job = Job(args, run_dir / "first.log")
    watcher = None
    try:
        watcher = TaskWatcher(job.dashboard(), "EntityShard.refresh")
        session = job.proc.pid
        # (a) a shard, in the middle of re-encoding its rows
        kill_shard_during_refresh(job, watcher, metrics, record)
        shard_pid = record["shard"]["pid"]
        watcher.stop()
        watcher = None
        # (b) a Ray Train worker, while the group trains, after the shard kill and at a step with no checkpoint
        # after it or after the next one: a step's checkpoint is saved after its loss is logged, so killed there
        # the group would resume exactly where it stopped and replay nothing. Not after the shard's restart: the
        # group trains on while Ray restarts the shard, and on a loaded machine (two `yes` beside `make test`)
        # the wait for that restart lasted until step 22, past the last step a worker kill could be aimed at.
        # The restart is checked below, before the driver is killed.
        after = record["shard"]["steps_logged"]

        def unsaved_step():
            last = max((s for s, _ in train_losses(metrics)), default=-1)
            if last >= after and not checkpointed(last + 1) and not checkpointed(last + 2):
                return True
            if last >= TOTAL_STEPS - 2:  # the restarted group must still train two steps past it
                pytest.fail(f"no step without a checkpoint was left to kill a worker at (at step {last}): {record}")
            return False

        # The workers' pids first (the group keeps them until this kill): scanning /proc between the wait and the
        # kill took long enough on a loaded machine (load average ~40, `make test` beside other work) for the
        # worker to train past the next checkpoint, so the group resumed with nothing to replay.
        workers = titled(session, b"ray::RayTrainWorker")
        assert len(workers) == 2, workers
        job.wait_for("a step without a checkpoint after it", unsaved_step, poll=0.02)
        os.kill(workers[-1], signal.SIGKILL)
        at_step = train_losses(metrics)[-1][0]
        record["worker"] = {"pid": workers[-1], "last_logged_step": at_step,
                            "at_s": round(time.monotonic() - job.started, 1)}

        # (c) the driver, once the restarted group has trained past the step it was killed at
        def retrained_past():
            steps = [s for s, _ in train_losses(metrics)]
            back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
            return back and steps[-1] >= at_step + 2 and {"restart_step": steps[back[0]]}

        record["worker"].update(job.wait_for("the restarted group to train on", retrained_past))
        record["worker"]["resumed_line"] = "worker 0/2: resumed at step" in job.output
        record["shard"]["restarted_as"] = job.wait_for("the shard's restart", lambda: (
            (now := titled(session, b"ray::EntityShard")) and len(now) == 2 and shard_pid not in now and now),
            timeout=300)
        record["driver"] = {"processes": processes_of(session, job.temp_dir),
                            "last_logged_step": train_losses(metrics)[-1][0],
                            "at_s": round(time.monotonic() - job.started, 1)}
        job.kill()
        record["driver"]["returncode"] = job.proc.returncode
        left, took = wait_until_gone(session, job.temp_dir)
        record["driver"].update(left=left, gone_after_s=round(took, 1))
    finally:
        if watcher:
            watcher.stop()
        job.kill()
        job.remove_temp_dir()
    record["first_output"] = job.output
    record["losses_before_rerun"] = train_losses(metrics)
    record["checkpoint_before_rerun"] = latest_checkpoint(storage)
    killed = {*record.get("driver", {}).get("processes", {}), record.get("worker", {}).get("pid")}
    record["scratch_before_rerun"] = scratch_of(killed)

    # the same command again: resumes
    rerun = Job(args, run_dir / "rerun.log")
    try:
        record["rerun_returncode"] = rerun.finish()
    finally:
        rerun.kill()
    record["rerun_seconds"] = round(time.monotonic() - rerun.started, 1)
    record["rerun_output"] = rerun.output
    record["rerun_left"], _ = wait_until_gone(rerun.proc.pid, rerun.temp_dir)
    rerun.remove_temp_dir()
    record["scratch_after_rerun"] = scratch_of(killed)
    record["losses"] = train_losses(metrics)
    record["summary"] = json.loads((run_dir / "out" / "summary.json").read_text())
    print("chaos:", json.dumps({k: record[k] for k in ("shard", "worker", "rerun_seconds")}, default=str))
    print("driver kill:", {k: v for k, v in record["driver"].items() if k != "processes"},
          f"({len(record['driver']['processes'])} processes of the job when it was killed)")
    return record


@pytest.fixture(scope="module")
def undisturbed(undisturbed_job):
    job, run_dir = undisturbed_job
    try:
        rc = job.finish()
    finally:
        job.kill()
    assert rc == 0, job.output[-4000:]
    left, _ = wait_until_gone(job.proc.pid, job.temp_dir)
    job.remove_temp_dir()
    assert not left, f"processes left by a run that ended normally: {left}"
    losses = dict(train_losses(run_dir / "out" / "metrics.jsonl"))
    print(f"undisturbed run: {time.monotonic() - job.started:.0f} s")
    return losses, json.loads((run_dir / "out" / "summary.json").read_text())


# ---------------------------------------------------------------------------- the checks

def test_each_kill_hit_what_it_aimed_at(chaos):
    shard = chaos["shard"]
    # killed while its refresh task was RUNNING: that attempt failed (it had not finished),
    # and Ray restarted the shard in a new process
    assert shard["error"] in ("ACTOR_DIED", "ACTOR_UNAVAILABLE", "WORKER_DIED"), shard
    assert shard["pid"] not in shard["restarted_as"], shard
    worker = chaos["worker"]
    # the group restarted from a checkpoint before the step the worker died in, and trained that step again
    assert checkpointed(worker["restart_step"]) and worker["restart_step"] <= worker["last_logged_step"], worker
    assert worker["resumed_line"], "the restarted worker group did not say it resumed"
    assert f"resumed at step {worker['restart_step']}" in chaos["first_output"]
    driver = chaos["driver"]
    assert driver["returncode"] == -signal.SIGKILL, driver
    assert "finished in" not in chaos["first_output"], "the first run ended before the driver was killed"


def test_a_killed_driver_leaves_no_process(chaos):
    driver = chaos["driver"]
    # the job had a whole Ray cluster running when its driver died ...
    titles = set(driver["processes"].values())
    # An actor busy in a method is titled ray::Class.method (an idle one ray::Class): match the class.
    for t in (b"ray::EntityShard", b"ray::RayTrainWorker", b"ray::DashboardAgent", b"ray::RuntimeEnvAgent"):
        assert any(x == t or x.startswith(t + b".") for x in titles), (t, sorted(titles))
    # ... and none of it was left ORPHAN_GRACE seconds later
    assert not driver["left"], f"orphans {driver['gone_after_s']} s after the driver was killed: {driver['left']}"
    assert not chaos["rerun_left"], f"processes left by the rerun: {chaos['rerun_left']}"


def test_the_rerun_removes_what_the_killed_processes_left_in_tmp(chaos):
    """The killed driver took its Ray Train controller down with its process group's store file in
    /tmp (and a killed worker may leave a half-staged checkpoint there): the rerun's first group and
    checkpoint on this machine remove them (dist_nce.core.scratch)."""
    before = chaos["scratch_before_rerun"]
    assert any(name.startswith("dist_nce_group_") for name in before), before
    assert chaos["scratch_after_rerun"] == [], (before, chaos["scratch_after_rerun"])


def test_the_rerun_resumes_and_matches_an_undisturbed_run(chaos, undisturbed):
    assert chaos["rerun_returncode"] == 0, chaos["rerun_output"][-4000:]
    out = chaos["rerun_output"]
    resumed = re.findall(r"worker 0/2: resumed at step (\d+)", out)
    assert resumed and "fresh start" not in out, out[-4000:]
    # from the newest checkpoint the killed run left
    assert int(resumed[0]) == chaos["checkpoint_before_rerun"] > 0, (resumed, chaos["checkpoint_before_rerun"])
    summary = chaos["summary"]
    assert summary["done"] and summary["step"] == TOTAL_STEPS
    reference, ref_summary = undisturbed
    assert sorted(reference) == list(range(TOTAL_STEPS)) and ref_summary["done"]
    # every step trained, some twice (after each restart), and every loss logged equals the
    # undisturbed run's loss at that step
    losses = chaos["losses"]
    assert sorted({s for s, _ in losses}) == list(range(TOTAL_STEPS))
    assert len(losses) > TOTAL_STEPS, "no step was trained twice: no restart happened"
    np.testing.assert_allclose([v for _, v in losses], [reference[s] for s, _ in losses], rtol=1e-5)
    after, ref_after = summary["dev_after"], ref_summary["dev_after"]
    keys = sorted(k for k in ref_after if k.startswith(("recall@", "accuracy", "n_")))
    assert keys and sorted(k for k in after if k.startswith(("recall@", "accuracy", "n_"))) == keys
    assert {k: after[k] for k in keys} == pytest.approx({k: ref_after[k] for k in keys}, rel=1e-5), (after, ref_after)
    assert summary["index_version"] == ref_summary["index_version"]
