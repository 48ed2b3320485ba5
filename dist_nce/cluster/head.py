"""A Ray head on this machine, started the way a cluster user starts one: ``ray start --head``.

The demo (``jobs/demo.py``) and the tests that submit jobs share this one launcher. What it
guarantees, in order:

* token authentication is ON, also on a machine that has never run Ray: the token is made
  first (:func:`dist_nce.cluster.runtime.ensure_auth_token`), ``RAY_AUTH_MODE=token`` is set for the
  head and for every client it hands out (:attr:`LocalHead.env`);
* nothing listens beyond loopback: node address, dashboard and agents on 127.0.0.1, and every
  port chosen free, distinct and below the kernel's ephemeral range (where the other Rays on the
  machine take ports by the dozen while this one starts: :func:`~dist_nce.cluster.runtime.free_port`),
  so a head runs beside any other Ray on the machine;
* the head runs ``--block`` in its own process session and dies with the process that
  started it (Linux ``PR_SET_PDEATHSIG``): a killed demo or test leaves no cluster behind;
  :meth:`LocalHead.stop` ends exactly this cluster (``ray stop`` would end every Ray here);
* it is up only when ``ray start`` says so ("Ray runtime started.") and its dashboard answers.
  The dashboard answers before the node is up, and on a loaded machine the node can still fail:
  the raylet gives the dashboard agent 15 s to write its port file and aborts when a slow Python
  start-up misses that (seen at a load of ~16 on 2 cores: the head looked up, every client then
  timed out on a dead GCS). Such a start is tried again, ``START_ATTEMPTS`` in all, each on new
  ports, the failed attempt's ``ray start`` log kept beside the next.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

from dist_nce.cluster.runtime import ensure_auth_token, forget_stopped_head, free_port, local_node_env, ray_env

# "Ray runtime started." is printed once the node is up; a failed start prints none. The retry is
# the remedy the raylet's fixed agent window leaves: the second start finds Ray's modules in the
# page cache.
STARTED = "Ray runtime started."
DRAIN_VAR = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
START_ATTEMPTS = 3
# Every listener of a head, each given an explicit free port (the defaults, e.g. the agent's
# 52365 or the client server's 10001, may belong to another Ray on the machine).
PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
              "--node-manager-port", "--object-manager-port")


def die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (``preexec_fn`` of a child)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LocalHead:
    """``ray start --head --block`` on loopback with token auth; a context manager.

    ``env`` (argument): overrides of this process's environment for the head, ``""`` removing a
    variable. ``env`` (attribute): what clients (``ray job submit``, drivers) need: the head's PATH,
    ``RAY_AUTH_MODE=token`` and the token's location. ``address``: the dashboard URL that
    ``ray job submit --address`` takes; ``gcs_address``: what ``ray.init(address=...)`` takes.
    ``temp_dir``: Ray's session files and logs (default: a new short directory, removed by
    :meth:`stop` unless ``keep_logs``).
    """

    def __init__(self, num_cpus: float = 2, *, env: Mapping[str, str] | None = None, temp_dir: str | None = None,
                 log: str | os.PathLike | None = None, keep_logs: bool = False, timeout_s: float = 180):
        self.num_cpus, self.timeout_s, self.keep_logs = num_cpus, timeout_s, keep_logs
        self.bin_dir = Path(sys.executable).parent
        self.env = ray_env({"PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                            "RAY_AUTH_MODE": "token", **(env or {})})
        self.env.pop("RAY_ADDRESS", None)  # a head of its own, not a client of another cluster
        for var, value in (env or {}).items():  # an override given as "" removes the variable
            if value == "":
                self.env.pop(var, None)
        # Unbuffered, so that `ray start --block` has written STARTED to its log before it blocks.
        self._start_env = {**self.env, "PYTHONUNBUFFERED": "1"}
        # On SIGTERM `ray start --block` first drains its node, up to this many seconds, so that Serve
        # proxies can finish in-flight requests (a KubeRay pod's upgrade). A LocalHead is stopped when
        # its work is done (the demo's job, a mini-paper grid, a test session), and once a job had run
        # the drain always lasted the whole default 30 s. A value set by the caller or the user wins.
        self._start_env.setdefault(DRAIN_VAR, "0")
        for var, value in local_node_env().items():  # a node on this machine (runtime.LOCAL_NODE_ENV)
            self._start_env.setdefault(var, value)
        self.token_location = ensure_auth_token(self.env)
        # Short: Ray's socket paths under the temp dir have a length limit (~107 bytes).
        self._own_temp = temp_dir is None
        self.temp_dir = Path(temp_dir or tempfile.mkdtemp(prefix="rh_", dir="/tmp"))
        self.log_path = Path(log) if log else self.temp_dir / "ray_start.log"
        self.ports = self._choose_ports()
        self.proc: subprocess.Popen | None = None
        self.failed_logs: list[Path] = []  # the `ray start` logs of failed attempts

    @staticmethod
    def _choose_ports() -> dict[str, int]:
        ports: dict[str, int] = {}
        for flag in PORT_FLAGS:  # nine distinct ports: none is bound until `ray start` runs
            ports[flag] = free_port(taken=set(ports.values()))
        return ports

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.ports['--dashboard-port']}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.ports['--port']}"

    def command(self) -> list[str]:
        return [str(self.bin_dir / "ray"), "start", "--head", "--block",
                *[x for flag, port in self.ports.items() for x in (flag, str(port))],
                "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--num-cpus={self.num_cpus:g}",
                "--disable-usage-stats", f"--temp-dir={self.temp_dir / 'ray'}"]

    def start(self) -> "LocalHead":
        attempt = 1
        while (why := self._start_once()) is not None:
            said = self.log_path.read_text(errors="replace")[-3000:]
            self._end_process()
            forget_stopped_head(self.ports["--port"])
            if attempt == START_ATTEMPTS:  # its logs stay for the reader of this error
                raise RuntimeError(f"ray start --head did not come up in {START_ATTEMPTS} attempts ({why}; log "
                                   f"{self.log_path}, earlier attempts {[str(p) for p in self.failed_logs]}):\n{said}")
            kept = self.log_path.with_name(f"{self.log_path.stem}.attempt{attempt}{self.log_path.suffix}")
            self.log_path.replace(kept)
            self.failed_logs.append(kept)
            attempt += 1
            print(f"ray start --head failed ({why}; log {kept}); starting it again on new ports "
                  f"({attempt}/{START_ATTEMPTS})", file=sys.stderr, flush=True)
            self.ports = self._choose_ports()
        return self

    def _start_once(self) -> str | None:
        """One ``ray start``: None once it is up (module docstring), else why not."""
        self._log = open(self.log_path, "w")
        # The node's processes are told its address (this attempt's ports): with another Ray on the machine,
        # Ray's state API called with no address (Ray Train's placement-group cleaner) found several.
        env = {**self._start_env, "RAY_ADDRESS": self.gcs_address}
        self.proc = subprocess.Popen(self.command(), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                return f"ray start exited with {self.proc.returncode}"
            if STARTED in self.log_path.read_text(errors="replace") and self._dashboard_up():
                return None
            if time.monotonic() > deadline:
                return f"not up after {self.timeout_s:g} s"
            time.sleep(1)

    def _dashboard_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.address}/api/version", timeout=2):
                return True
        except urllib.error.HTTPError:  # it answers (401 without the token): it is up
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM to ``ray start --block``: it stops every process it started and exits; then
        SIGKILL to the process group for anything left behind."""
        if self.proc is None:
            return
        self._end_process()
        forget_stopped_head(self.ports["--port"])
        if self._own_temp and not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _end_process(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None
        self._log.close()

    def __enter__(self) -> "LocalHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
