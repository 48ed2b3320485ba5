"""dist_nce.cluster.runtime: a local Ray listens on loopback only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Started in its own process so that no other cluster of the test session is counted; it
# prints the TCP sockets its own Ray processes listen on (from /proc/net/tcp{,6} and /proc/<pid>/fd).
SCRIPT = r"""
import json, os, ray
from dist_nce.cluster.runtime import init_ray

def descendants(root):
    parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                parent[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in out} - out
        out |= more
        grew = bool(more)
    return out

def socket_inodes(pids):
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    return inodes

def listening(inodes):
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, and a socket of this Ray's processes
                out.add(f[1])
    return out

def ray_servers():  # this process's GCS servers and raylets, by executable name
    names = {}
    for pid in descendants(os.getpid()) - {os.getpid()}:
        try:
            exe = os.path.basename(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode())
        except OSError:
            continue
        if exe in ("gcs_server", "raylet"):
            names[exe] = names.get(exe, 0) + 1
    return names

# The first start misses Ray's 30 s raylet-registration window, as on a loaded machine: the node's
# lookup fails once while its clock jumps ahead, so that start raises "timed out during startup"
# after starting a real GCS and raylet. init_ray must stop those and start again.
import time as real_time
import ray._private.node as node_mod
import ray._private.services as services
from dist_nce.cluster import runtime

real_get_node, offset, failed = services.get_node, [0.0], []

class Clock:
    def __getattr__(self, name):
        return getattr(real_time, name)

    def monotonic(self):
        return real_time.monotonic() + offset[0]

def get_node(*args, **kwargs):
    if not failed:
        failed.append(1)
        offset[0] = 1000.0
        raise RuntimeError("node not registered yet (test)")
    offset[0] = 0.0
    return real_get_node(*args, **kwargs)

node_mod.time, services.get_node = Clock(), get_node
runtime.STARTUP_BACKOFF_S = 0.0
init_ray(num_cpus=1, runtime_env={"env_vars": {"DIST_NCE_CALLERS_VAR": "mine"}})
node_mod.time, services.get_node = real_time, real_get_node
servers = ray_servers()
NAMES = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "DIST_NCE_CALLERS_VAR",
         "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
worker_env, worker_actor_env = ray.get(ray.remote(num_cpus=0)(
    lambda: ({k: os.environ.get(k) for k in NAMES}, runtime.actor_runtime_env())).remote())
job_env = {"runtime_env": ray.get_runtime_context().runtime_env, "worker": worker_env,
           "driver": {k: os.environ.get(k) for k in NAMES},
           "actor_runtime_env": {"driver": runtime.actor_runtime_env(), "worker": worker_actor_env}}

def state_api_from_a_worker():  # as Ray Train's placement-group cleaner asks it: no address given
    from ray.util.state import list_actors
    return os.environ.get("RAY_ADDRESS"), [a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")])]

class Marker:
    pass

marker = ray.remote(num_cpus=0)(Marker).remote()
ray.get(marker.__ray_ready__.remote())
job_env["address"] = {"gcs": ray.get_runtime_context().gcs_address, "driver": os.environ.get("RAY_ADDRESS"),
                      "worker": ray.get(ray.remote(num_cpus=0)(state_api_from_a_worker).remote())}
# Only this cluster's sockets: the processes init_ray started descend from this one, so other
# programs on the machine (another Ray, a server) cannot make the check fail or pass.
new = sorted(listening(socket_inodes(descendants(os.getpid()))))
ray.shutdown()
print(json.dumps({"listening": new, "failed_starts": len(failed), "servers": servers, "env": job_env}))
"""

# 127.0.0.1, ::1 and ::ffff:127.0.0.1, as /proc/net prints them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.fixture(scope="module")
def local_start():
    """SCRIPT's report: one local Ray started by init_ray after a start that timed out."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM",
                                                               "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
                                                               "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.ray
def test_a_local_start_that_times_out_is_stopped_and_tried_again(local_start):
    report, stderr = local_start
    assert report["failed_starts"] == 1 and "trying again (2/3)" in stderr, stderr[-2000:]
    # the timed-out start's GCS and raylet were stopped: one of each is left, the running node's
    assert report["servers"] == {"gcs_server": 1, "raylet": 1}, report


@pytest.mark.ray
def test_a_local_rays_workers_get_the_settings_from_the_node_not_from_a_runtime_env(local_start):
    """Workers of a job with a runtime env start through Ray's setup_worker.py (an extra interpreter and
    its imports): a local node started by init_ray carries the settings itself, the caller's own
    variables included, and this process's environment is as it was."""
    env = local_start[0]["env"]
    assert env["runtime_env"] == {}, env
    # (the PreemptionWatcher setting is the local node's only: runtime.LOCAL_NODE_ENV)
    assert env["worker"] == {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                             "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25", "DIST_NCE_CALLERS_VAR": "mine",
                             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}, env
    assert env["driver"] == {"OMP_NUM_THREADS": None, "TOKENIZERS_PARALLELISM": None,
                             "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25", "DIST_NCE_CALLERS_VAR": None,
                             "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": None}, env
    # ... and so do the shards started there, by the driver or by a worker (a Serve replica)
    assert env["actor_runtime_env"] == {"driver": {}, "worker": {}}, env


@pytest.mark.ray
def test_a_local_rays_processes_know_their_own_cluster(local_start):
    """Ray's state API, called with no address in a process of the node (Ray Train's placement-group
    cleaner does), searched the machine for a GCS and failed with another Ray running there ("Found
    multiple active Ray instances"). The node's processes are told their own address; the driver's
    environment is as it was. (The suite runs other clusters beside this one, so the search would meet
    them; the answer below can only come from this cluster.)"""
    address = local_start[0]["env"]["address"]
    assert address["driver"] is None, address
    seen, alive = address["worker"]
    assert seen == address["gcs"] and seen.startswith("127.0.0.1:"), address
    assert "Marker" in alive, alive  # this cluster's actor, found through the state API


def test_actors_started_under_a_plain_ray_init_get_the_settings_as_their_runtime_env(monkeypatch):
    from dist_nce.cluster import runtime

    monkeypatch.delenv(runtime.NODE_SETTINGS_MARK, raising=False)
    monkeypatch.setattr(runtime, "_local_node", None)
    assert runtime.actor_runtime_env() == {"env_vars": runtime.ray_runtime_env_vars()}
    assert runtime.actor_runtime_env()["env_vars"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.ray
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_local_ray_listens_on_loopback_only(local_start):
    new = local_start[0]["listening"]
    assert new, "init_ray started no listener at all?"
    outside = [a for a in new if a.rsplit(":", 1)[0] not in LOOPBACK]
    assert not outside, f"listening beyond loopback: {outside}"


def test_forget_stopped_head_removes_only_that_heads_record(tmp_path, monkeypatch):
    import ray._common.utils as ray_utils

    from dist_nce.cluster.runtime import forget_stopped_head

    record = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(ray_utils, "get_ray_address_file", lambda temp_dir: str(record))
    assert not forget_stopped_head(6379)  # nothing recorded
    record.write_text("127.0.0.1:40001")
    assert not forget_stopped_head(6379) and record.exists()  # another head's record stays
    assert forget_stopped_head(40001) and not record.exists()


def test_jit_builds_are_pinned_to_this_interpreter(tmp_path, monkeypatch):
    """The venv's ninja comes first on PATH (once), the build cache lives in the venv, and a
    TORCH_EXTENSIONS_DIR the user set is kept."""
    import os

    from dist_nce.cluster.runtime import pin_jit_builds

    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", "/usr/bin" + os.pathsep + bin_dir)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    pin_jit_builds()
    pin_jit_builds()
    parts = os.environ["PATH"].split(os.pathsep)
    assert os.path.exists(os.path.join(bin_dir, "ninja"))  # deepspeed depends on ninja
    assert parts[0] == bin_dir and parts.count(bin_dir) == 2, parts
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    pin_jit_builds()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def _fake_ray(monkeypatch, failures):
    """ray.init fails with each of ``failures`` in turn, then joins; what was called is recorded."""
    import ray

    from dist_nce.cluster import runtime

    calls = []

    def init(address=None, **kw):
        calls.append(("init", address))
        if failures:
            cause = failures.pop(0)
            try:
                raise cause
            except Exception as e:
                raise ConnectionError(f"Failed to connect to Ray cluster at {address}") from e
        return "joined"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", None)))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: calls.append(("sleep", s)))
    return runtime, calls


def test_joining_a_slow_head_is_retried(monkeypatch):
    """A head whose GCS misses Ray's node lookup window (a loaded machine) is joined again."""
    slow = RuntimeError("Failed to get node info for possible node ids: {'ab'} when trying to resolve node")
    runtime, calls = _fake_ray(monkeypatch, [slow, slow])
    assert runtime.init_ray(address="127.0.0.1:1") == "joined"
    assert [c[0] for c in calls] == ["init", "shutdown", "sleep", "init", "shutdown", "sleep", "init"]


def test_a_slow_local_start_is_retried_and_other_failures_are_not(monkeypatch):
    """The local node's 30 s registration window (Ray's node.py) is the one local failure tried again."""
    import ray

    from dist_nce.cluster import runtime

    calls = []
    failures = [Exception("The current node timed out during startup. This could happen because ..."),
                ValueError("bad option")]

    def init(address=None, **kw):
        calls.append(("init", address, kw.get("dashboard_port")))
        raise failures.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown",)))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: calls.append(("sleep", s)))
    with pytest.raises(ValueError, match="bad option"):
        runtime.init_ray(num_cpus=1)
    assert [c[0] for c in calls] == ["init", "shutdown", "sleep", "init"]
    assert calls[0][1] == calls[3][1] == "local" and calls[0][2] != calls[3][2]  # a new dashboard port


def test_joining_is_not_retried_forever_nor_for_other_failures(monkeypatch):
    slow = RuntimeError("Failed to get node info for possible node ids: {'ab'}")
    runtime, calls = _fake_ray(monkeypatch, [slow, slow, slow])
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        runtime.init_ray(address="127.0.0.1:1")
    assert [c[0] for c in calls].count("init") == runtime.STARTUP_ATTEMPTS
    runtime, calls = _fake_ray(monkeypatch, [OSError("connection refused")])  # no head there: at once
    with pytest.raises(ConnectionError):
        runtime.init_ray(address="127.0.0.1:1")
    assert calls == [("init", "127.0.0.1:1")]



def test_free_ports_lie_outside_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    """A chosen port is bound later by another process: one from the kernel's ephemeral range could be
    given to any socket bound to port 0 in between (runtime.PORT_RANGE)."""
    import os
    import socket

    from dist_nce.cluster import runtime

    ephemeral = runtime.EPHEMERAL_RANGE_FILE
    first_ephemeral = int(Path(ephemeral).read_text().split()[0]) if os.path.exists(ephemeral) else 32768
    assert all(20000 <= runtime.free_port() < min(32768, first_ephemeral) for _ in range(50))

    def free(port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    base = next(p for p in iter(runtime.free_port, None) if free(p + 1) and free(p + 2))
    # Of three ports, one in use and one in `taken`: only the third is ever returned.
    monkeypatch.setattr(runtime, "_port_range", lambda: (base, base + 2))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", base))
        assert {runtime.free_port(taken={base + 1}) for _ in range(30)} == {base + 2}
        # Nothing left in the range: the kernel's choice, still not a taken one.
        monkeypatch.setattr(runtime, "_port_range", lambda: (base, base + 1))
        assert runtime.free_port(taken={base + 1}) not in (base, base + 1)


def test_a_local_heads_ports_are_distinct(tmp_path, monkeypatch):
    from dist_nce.cluster import head as head_mod

    # The draws repeat a port: the head must not hand it to two of its listeners.
    draws = iter([21000, 21000, 21001, 21000, 21002, 21003, 21004, 21005, 21006, 21007, 21008])
    monkeypatch.setattr("dist_nce.cluster.runtime.random.SystemRandom.randint", lambda self, a, b: next(draws))
    # Every draw counts as free: a neighbour's Ray holding one of these ports must not change the draws
    # (CI saw the scripted list run out when 21000-21008 had a port in use).
    monkeypatch.setattr("dist_nce.cluster.runtime._bindable", lambda port: True)
    h = head_mod.LocalHead(env={"HOME": str(tmp_path)}, temp_dir=str(tmp_path / "t"))
    assert sorted(h.ports.values()) == list(range(21000, 21009)) and len(h.ports) == len(head_mod.PORT_FLAGS)


def test_ray_workers_get_the_local_settings_and_a_users_value_wins(monkeypatch):
    """Every Ray worker of ours (Ray Train's controller included) polls at the project's interval,
    unless the user set one (runtime.RAY_LOCAL_ENV)."""
    from dist_nce.cluster.runtime import RAY_LOCAL_ENV, ray_runtime_env_vars

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    env = ray_runtime_env_vars()
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == RAY_LOCAL_ENV["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    assert ray_runtime_env_vars()["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"


def test_a_process_start_imports_faiss_without_its_loaders_info_lines():
    """faiss's loader logs at INFO each CPU-specific library the wheel lacks before loading the next
    (Ray's workers print it); configure_process imports faiss with those lines off, its own only."""
    pytest.importorskip("faiss")
    head = "import logging; logging.basicConfig(level=logging.INFO); "

    def stderr_of(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", head + code], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    assert "INFO:faiss.loader:" in stderr_of("import faiss")  # what a plain import prints here
    quiet = stderr_of("from dist_nce.cluster.runtime import configure_process; configure_process(); "
                      "import faiss, logging; assert logging.getLogger('faiss.loader').level == logging.WARNING")
    assert "faiss.loader" not in quiet and "swigfaiss" not in quiet, quiet
