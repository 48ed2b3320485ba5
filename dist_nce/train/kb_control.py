"""Take a KB delta while a run trains: the control file the driver watches, and the API.

After ``jobs/update_kb.py`` has written a new KB version of the run's store, ask the
running job to serve it, from any process that sees the run directory::

    python -m dist_nce.train.kb_control runs/aida/my_run            # the store's current version
    python -m dist_nce.train.kb_control runs/aida/my_run --kb-version 3

or, in Python, ``request_update(run_dir, kb_version)``. Both write ``<run_dir>/kb_update.json``
atomically. The AIDA job's driver (``dist_nce.train.driver.run_training``) runs a :class:`KbWatcher` beside training:
every ``interval_s`` it looks for that file and calls ``NegativeService.apply_delta`` (the
shards encode only the new rows, with the weights they serve, and swap in a new index version
without stopping training); the request is then replaced by ``kb_update.done.json`` (index
version, KB version, seconds) or ``kb_update.failed.json`` (the error). A request the shards cannot
serve yet (restarted shards hold no encoder with the weights they serve until the next refresh)
stays and is applied at the first poll after that refresh. Training workers follow
from the first answer of the new index version on (``dist_nce.train.kb_follow``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from dist_nce.actors.protocols import NegativeSource
from dist_nce.core.artifacts import atomic_write_json

CONTROL_FILE = "kb_update.json"
DONE_FILE = "kb_update.done.json"
FAILED_FILE = "kb_update.failed.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def request_update(run_dir: str | os.PathLike, kb_version: int | None = None) -> Path:
    """Ask the run in ``run_dir`` to serve KB version ``kb_version`` (None: the store's current one)."""
    if kb_version is not None and (isinstance(kb_version, bool) or not isinstance(kb_version, int) or kb_version < 0):
        raise ValueError(f"kb_version must be an int >= 0 or None, got {kb_version!r}")
    path = Path(run_dir) / CONTROL_FILE
    atomic_write_json(path, {"kb_version": kb_version, "requested_utc": _now()})
    return path


def apply_request(service: NegativeSource, run_dir: str | os.PathLike) -> dict | None:
    """One look at the control file: apply the request it holds, record the outcome, remove it.
    Returns the outcome, or None when there is no request."""
    run_dir = Path(run_dir)
    path = run_dir / CONTROL_FILE
    if not path.exists():
        return None
    t0 = time.perf_counter()
    for old in (DONE_FILE, FAILED_FILE):  # an earlier request's outcome: this one's replaces it
        (run_dir / old).unlink(missing_ok=True)
    try:
        request = json.loads(path.read_text(encoding="utf-8"))
        kb_version = request.get("kb_version") if isinstance(request, dict) else None
        version = service.apply_delta(kb_version)
        outcome = {**request, "index_version": int(version), "served_kb_version": int(service.kb_version),
                   "seconds": round(time.perf_counter() - t0, 3), "applied_utc": _now()}
        atomic_write_json(run_dir / DONE_FILE, outcome)
    except Exception as e:  # noqa: BLE001 - recorded for the person who asked; training goes on
        from dist_nce.actors.calls import cause

        c = cause(e)  # a shard's refusal arrives wrapped in Ray's error, whose text carries remote tracebacks
        why = str(c).strip().splitlines()[-1] if str(c).strip() else ""
        outcome = {"error": f"{type(c).__name__}: {why}", "traceback": traceback.format_exc(), "failed_utc": _now()}
        atomic_write_json(run_dir / FAILED_FILE, outcome)
        if "weights of the version served" in str(e):
            # Shards reloaded from disk hold no encoder until the next refresh: keep the request, the
            # next poll after that refresh applies it.
            outcome["retry"] = True
            return outcome
    path.unlink(missing_ok=True)
    return outcome


class KbWatcher:
    """A daemon thread applying control-file requests while training runs (``with KbWatcher(...):``)."""

    def __init__(self, service: NegativeSource, run_dir: str | os.PathLike, interval_s: float = 5.0, log=print):
        self.service, self.run_dir, self.interval_s, self.log = service, Path(run_dir), float(interval_s), log
        self.outcomes: list[dict] = []
        self._waiting: str | None = None  # the reason a kept request last waited for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kb-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> dict | None:
        outcome = apply_request(self.service, self.run_dir)
        if outcome is not None:
            self.outcomes.append(outcome)
            if outcome.get("retry"):  # said once per reason, not at every poll until the next refresh
                if outcome["error"] != self._waiting:
                    self._waiting = outcome["error"]
                    self.log(f"KB update: {outcome['error']}; kept, and tried again at each poll (it applies "
                             "once a refresh gives the shards the weights they serve)")
                return outcome
            self._waiting = None
            self.log(f"KB update: {outcome.get('error') or 'serving KB version %s as index version %s' % (outcome['served_kb_version'], outcome['index_version'])}")
        return outcome

    def __enter__(self) -> "KbWatcher":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ask a running training job to serve a new KB version")
    ap.add_argument("run_dir", help="the run's output directory (run.output_dir)")
    ap.add_argument("--kb-version", type=int, default=None, help="default: the store's current version")
    args = ap.parse_args(argv)
    if args.kb_version is not None and args.kb_version < 0:
        ap.error(f"--kb-version: must be >= 0, got {args.kb_version}")
    if not Path(args.run_dir).is_dir():  # a typo would otherwise make a directory no run watches
        print(f"error: run_dir {args.run_dir}: no such directory (the run's run.output_dir, made when it starts)",
              file=sys.stderr)
        return 2
    print(f"requested: {request_update(args.run_dir, args.kb_version)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
