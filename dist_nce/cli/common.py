"""The start every config-driven job shares: ``--config/--set/--dry-run/--help-config``, the
tiny models a config names, the input checks, and how a bad config or input is reported
(``error: ...`` on stderr, exit status 2, no traceback)."""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from dist_nce.core.config import ConfigError, describe, load_config
from dist_nce.core.flags import FlagParser, existing
from dist_nce.core.models import ensure_tiny_models
from dist_nce.core.run_lock import LOCK_FILE, LockUnsupported, RunDirBusy, RunLock, acquire

C = TypeVar("C")

# The checkout this package is imported from: the editable install's, or under
# `ray job submit --working-dir .` Ray's copy (Ray puts it first on PYTHONPATH). The jobs that
# start other jobs (demo, mini_paper) run jobs/*.py and keep data/ and runs/ there.
CHECKOUT = Path(__file__).resolve().parents[2]

DRY_RUN_HELP = ("check the config and every input path, then exit (no data generated or prepared, no Ray; the "
                "project's random tiny BERT is built first where the config names it; a store already prepared "
                "is checked as the run checks it: K, shards, a rerun's checkpoints)")


def error(e: BaseException | str) -> int:
    """Report a bad config or input (a user's mistake, not a bug: no traceback); exit status 2."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def interrupted(run: Any) -> int:
    """After a Ctrl-C during training: say how the run goes on; exit status 130, as shells report SIGINT.

    Why: Ray Train (2.60) aborts the run on SIGINT, and the driver's waiting ``ray.get`` then raises
    SystemExit(1), so a job used to end with status 1 and no word. ``run``: the job config's ``run``
    section (``storage_path``, ``name``): where the rerun resumes (:func:`~dist_nce.worker.launch.resume_point`)."""
    from dist_nce.worker.launch import resume_point, storage_uri

    point = resume_point(storage_uri(run.storage_path), run.name)
    if point is not None:
        said = f"interrupted: run the same command again to resume from step {point[0]} ({point[1]})"
    elif "://" in run.storage_path:
        said = "interrupted: run the same command again to resume from its last checkpoint"
    else:
        said = "interrupted before a whole checkpoint was written: the same command again starts the run over"
    print(said, file=sys.stderr, flush=True)
    return 130


def interrupted_preparing(where: str) -> int:
    """After a Ctrl-C while a job prepared its data (``where``: the store's directory): say how it goes
    on, as ``jobs/prepare_kb.py`` does, instead of a KeyboardInterrupt traceback; exit status 130."""
    print(f"interrupted while preparing the data ({where}): the chunks done are kept; run the same command "
          "again to resume", file=sys.stderr, flush=True)
    return 130


def dry_run_ok(what: str) -> int:
    print(f"{what}: config and inputs OK (dry run: no data generated or prepared, no Ray started)")
    return 0


RUN_INSTEAD = "use another run.name / run.output_dir"


def hold_run(run: Any) -> contextlib.ExitStack | int:
    """Take a training run for this job (:mod:`dist_nce.core.run_lock`): ``run.output_dir``, and Ray Train's
    run ``<run.storage_path>/<run.name>`` where that storage is a local path the job uses (two jobs of one
    name and storage but other output directories would share its checkpoints). The locks last while the
    returned stack is open; exit status 2, with one line naming the directory and its holder, when another
    live job holds one. ``run``: a job config's ``run`` section. Call it after ``--dry-run`` has returned:
    checking a config while its run trains is no second run."""
    targets = [(run.output_dir, LOCK_FILE, f"run directory {run.output_dir}")]
    if "://" not in run.storage_path and getattr(run, "backend", "ray") != "local":
        # beside Ray Train's run directory, not in it: a local run directory without Ray Train's snapshot
        # is one whose checkpoints are recovered (dist_nce.worker.launch.resume_point)
        targets.append((run.storage_path, f".{run.name}.lock",
                        f"Ray Train run {Path(run.storage_path) / run.name}"))
    return hold(targets, RUN_INSTEAD)


def take(directory: str | Path, what: str, instead: str, name: str = LOCK_FILE) -> RunLock | None:
    """``run_lock.acquire``, or None after a warning where the filesystem keeps no locks (the job runs
    unguarded). RunDirBusy and OSError (the directory or file cannot be made) go to the caller."""
    try:
        return acquire(directory, name=name, what=what, instead=instead)
    except LockUnsupported as e:
        print(f"warning: {e}: nothing stops a second job on {what} meanwhile", file=sys.stderr, flush=True)
        return None


def hold(targets: list[tuple[str | Path, str, str]], instead: str) -> contextlib.ExitStack | int:
    """Lock each (directory, lock file name, what it is) of ``targets`` for as long as the returned stack
    is open, or release them all and return 2 after one line on stderr naming the first one another live
    job holds (or that cannot be made). A filesystem without locks gets a warning and no lock."""
    held = contextlib.ExitStack()
    for directory, name, what in targets:
        try:
            lock = take(directory, what, instead, name)
            if lock is not None:
                held.enter_context(lock)
        except RunDirBusy as e:
            held.close()
            return error(e)
        except OSError as e:  # the directory or the file cannot be made (permissions, a file in the way)
            held.close()
            return error(f"{what}: cannot take its lock: {e}")
    return held


def retriever_models(model: Any) -> dict[str, str]:
    """Config key -> path of the encoders a retriever's ``model`` section names."""
    return {"model.retriever.mention_model": model.retriever.mention_model,
            "model.retriever.entity_model": model.retriever.entity_model}


@dataclass(frozen=True)
class ConfigJob(Generic[C]):
    """How one job turns ``--config YAML --set key=value ...`` into a config it can run."""

    kind: type[C]
    config_help: str  # the --config line of --help
    absolute: Callable[[C], C]  # relative paths resolved here: Ray Train workers run in another directory
    models: Callable[[C], dict[str, str]]  # config key -> model path
    check: Callable[[C], None]  # raises ConfigError naming every missing input
    # --dry-run only: what the run checks once its data is prepared, against the data there is now
    # (raises ConfigError); the run itself checks it after preparing
    prepared: Callable[[C], None] | None = None

    def parser(self, doc: str, progress: str | None = None) -> argparse.ArgumentParser:
        """The job's command line; ``progress``: help of a ``--no-progress`` flag, if it has one."""
        ap = FlagParser(description=doc.split("\n")[0])
        ap.add_argument("--config", type=existing("file", "config file"), help=self.config_help)
        ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
        if progress:
            ap.add_argument("--no-progress", dest="progress", action="store_false", help=progress)
        ap.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
        ap.add_argument("--help-config", action="store_true", help="print every config field and exit")
        return ap

    def ready(self, cfg: C) -> C:
        """Build the tiny models ``cfg`` names, then check its inputs (raises ConfigError)."""
        # A config naming the project's tiny-model path (data/models/tiny_bert) runs from a fresh
        # clone: the random tiny BERT is built there on first use, before the input checks.
        ensure_tiny_models(self.models(cfg))
        self.check(cfg)
        return cfg

    def start(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> C | int:
        """The checked config, or the exit status when the job ends here (``--help-config``, a
        config or input error, a passed ``--dry-run``). Every key and input is checked before
        any data or cluster work."""
        if args.help_config:
            print(describe(self.kind))
            return 0
        if not args.config:
            ap.error("--config is required")
        try:
            cfg = self.ready(self.absolute(load_config(self.kind, args.config, args.set)))
            if args.dry_run and self.prepared is not None:
                self.prepared(cfg)
        except (ConfigError, FileExistsError) as e:
            return error(e)
        if args.dry_run:
            return dry_run_ok(args.config)
        return cfg
