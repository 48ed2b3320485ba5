"""The one place for this project's process-level workarounds (docs/design.md, section 7a).

Nothing here runs at import time: jobs, actors and tests call these functions
explicitly at their start.

* threads: 2-core machines slow down 10-50x when processes oversubscribe cores;
* faiss: faiss skips BLAS for query batches below ``distance_compute_blas_threshold``
  (default 128000), which makes flat search ~8x slower for training-size batches;
* Ray: bind to loopback unless configured otherwise, no usage-stats network call; token
  authentication made and switched on before any head starts (``ray start`` leaves it off on
  a machine that has never run Ray); a local cluster ends with its driver (cluster.reaper);
* DeepSpeed: a single process outside a launcher needs the torch.distributed env vars.
"""
from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

FAISS_BLAS_THRESHOLD = 20

# Environment for Ray processes started by this project (driver, `ray start`, workers).
RAY_LOCAL_ENV = {
    # Without this Ray binds to the machine's routable address; keep local runs on loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Serve's HTTP proxy must answer its readiness check within 5 s, three times in a row, or the
    # controller kills it and `serve.run` fails (ActorDiedError); on 2 busy cores it can take longer.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    # Ray Train's controller polls its workers every 2 s by default, and a worker's train.report
    # (every checkpoint) blocks until the controller has collected its previous report: each
    # checkpoint waited up to 2 s, and a run's start and end a few polls more. At 0.25 s a tiny
    # 24-step run (configs/aida/test_tiny.yaml, checkpoints every 3 steps) took 25 s in fit()
    # instead of 54 s. A poll is one small call per worker; one that misses its interval is
    # waited for, not counted as a failure (that takes RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
}


# Set for the nodes this project starts on this machine only (init_ray's local node, a LocalHead), not for
# a cluster's nodes; a value in the environment wins. Ray Train's PreemptionWatcher actor watches for cloud
# preemptions, which a node here never has, and its start printed an error line in every run, the demo's
# included ("core_worker.cc: Actor with class name: 'PreemptionWatcher' ... has constructor arguments in
# the object store and max_restarts > 0", ray-project/ray#53727).
LOCAL_NODE_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def local_node_env() -> dict[str, str]:
    """:data:`LOCAL_NODE_ENV`, where this process's environment does not set a value of its own."""
    return {k: os.environ.get(k, v) for k, v in LOCAL_NODE_ENV.items()}


def configure_threads(n: int | None = 1) -> None:
    """Pin intra-op threads for this process (torch, OpenMP, MKL, faiss)."""
    if n is None:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        faiss = _import_faiss()
        faiss.omp_set_num_threads(n)
    except ImportError:  # configure_faiss reports a missing faiss (require_faiss)
        pass


def configure_faiss(blas_threshold: int = FAISS_BLAS_THRESHOLD) -> None:
    """Make faiss use BLAS for small query batches (see module docstring)."""
    faiss = require_faiss()

    faiss.cvar.distance_compute_blas_threshold = blas_threshold


def configure_process(threads: int | None = 1, faiss: bool = True) -> None:
    """Everything a worker, actor or job process applies at its start (``faiss=False``: a
    process that searches nothing, such as the reranker's, and need not have faiss).

    A process without faiss at all runs on: the exact torch backend needs none (a GPU machine with
    torch but no faiss-gpu wheel runs the one-GPU AIDA job), and the faiss backends ask for it when
    they build an index (:func:`require_faiss`: the install advice). A broken faiss (the remnant of an
    uninstalled twin) is still an error here."""
    configure_threads(threads)
    if faiss:
        try:
            configure_faiss()
        except FaissMissing:
            pass


def faiss_installed() -> bool:
    """Whether faiss imports (a broken one, the remnant of an uninstalled twin, still raises)."""
    try:
        require_faiss()
    except FaissMissing:
        return False
    return True


class FaissMissing(ImportError):
    """``import faiss`` failed: no faiss in this environment (:func:`require_faiss`)."""


def pin_jit_builds() -> None:
    """Make DeepSpeed's JIT-built C++ ops build once per interpreter, not once per caller.

    On a CPU accelerator DeepSpeed compiles its shared-memory allreduce op at every process
    group's start (1-2 min on 2 cores) unless torch's build cache is current. torch re-runs
    ``ninja`` from PATH on each load with a build directory in ~/.cache shared by every venv:
    processes whose PATH finds the system's ninja (1.11) and those finding the venv's (1.13,
    another log hash), or two venvs (the README tests' fresh clones), each see the other's
    build as stale and rebuild it, again and again. Pinned to this interpreter: its own ninja
    first on PATH and a build directory inside its prefix (``TORCH_EXTENSIONS_DIR`` if unset).
    """
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.exists(os.path.join(bin_dir, "ninja")) and path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + path
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def import_deepspeed():
    """``import deepspeed``, without the mlflow import that DeepSpeed's autotuner makes; returns the module.

    ``deepspeed.runtime.config`` imports ``deepspeed.autotuning``, whose module imports mlflow at
    once when it is installed (the tracking extra, and the dev install) to log autotuning
    experiments, which this project never runs: 0.5-0.8 CPU-s in every process that builds an
    engine, each Ray Train worker of each run, even with tracking off. mlflow is hidden only while
    DeepSpeed's modules load (the autotuner then records that it has none) and imports normally
    afterwards; a process that already imported mlflow (tracking on) keeps it as it is.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which DeepSpeed catches
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory op, which this project never calls.

    ``deepspeed.comm`` builds that op (a C++ JIT build: 1-2 min on 2 cores, once per venv, in
    the first process that starts a group) whenever the accelerator has it, but the op serves
    only ``inference_all_reduce`` (tensor-parallel inference). Training all-reduces go through
    ``torch.distributed`` with or without it, so marking it incompatible changes no result and
    spares every fresh environment (each demo, each CI run) the build.
    """
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def faiss_has_gpu() -> bool:
    faiss = require_faiss()  # a faiss backend on a CUDA device asks this first: give the install advice
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def ensure_auth_token(env: Mapping[str, str] | None = None) -> str:
    """Make sure a Ray authentication token exists where Ray looks for it; return where.

    Ray 2.60 reads the token from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``,
    else ``~/.ray/auth_token``. ``ray.init()`` creates that file for a new local cluster, but
    ``ray start`` does not: on a machine that has never run Ray it starts with token auth OFF
    (a warning only), or, with ``RAY_AUTH_MODE=token``, its GCS aborts at start. Every head
    this project starts calls this first, so token auth is really on from the first run.
    A created file holds 256 random bits, readable by its owner only.
    """
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path(env.get("HOME") or Path.home()) / ".ray" / "auth_token")
    path = path.expanduser()
    try:
        if path.read_text(encoding="utf-8").strip():
            return str(path)
        empty = True
    except FileNotFoundError:
        empty = False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(32))
    try:
        if empty:
            os.replace(tmp, path)
        else:
            # Create-if-absent: two processes starting their first Ray at once must end with one
            # token, the first one written; replacing it would lock out the cluster made with it.
            os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(path)


def enable_token_auth() -> str:
    """Token authentication on for this process and every Ray process it starts afterwards
    (``ray.cluster_utils.Cluster`` nodes, ``ray.init`` clients); returns the token's location.

    Ray caches ``RAY_AUTH_MODE`` in its process-wide config the first time it is read, so
    setting the variable is not enough once ray has been imported and used: the config and
    the token cache are reloaded, as ``ray.init`` does for a new local cluster.
    """
    where = ensure_auth_token()
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return where


def ray_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``os.environ`` with the local-Ray settings applied."""
    env = dict(os.environ)
    for k, v in RAY_LOCAL_ENV.items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


def ray_runtime_env_vars() -> dict[str, str]:
    """Env vars every Ray worker process of ours gets (threads, loopback)."""
    # A value set in this process's environment (init_ray sets the defaults there) wins.
    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            **{k: os.environ.get(k, v) for k, v in RAY_LOCAL_ENV.items()},
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if has_cuda() else "cpu")}


# In the environment of a local node init_ray starts, beside the workers' settings: a process on that
# node (a Serve replica starting shards) knows that the node passes the settings on.
NODE_SETTINGS_MARK = "DIST_NCE_NODE_HAS_SETTINGS"
GCS_PORT_VAR = "RAY_GCS_SERVER_PORT"  # read by Ray 2.60's node.py when a process starts a head node
_local_node: str | None = None  # the GCS address of the local node this process started (init_ray)


def actor_runtime_env() -> dict[str, Any]:
    """The runtime env for an actor of ours: none where its node passes the workers' settings on
    (a local node init_ray started: the actor then starts without setup_worker.py, as in
    :func:`init_ray`), else the settings (:func:`ray_runtime_env_vars`), so that an actor started
    under a plain ``ray.init()`` gets them too."""
    import ray

    if os.environ.get(NODE_SETTINGS_MARK) == "1" or (
            _local_node is not None and ray.get_runtime_context().gcs_address == _local_node):
        return {}
    return {"env_vars": ray_runtime_env_vars()}


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]):
    """``os.environ`` with ``values`` set (None: unset) inside the block, as it was after it: for a
    process started or a library called there that reads them."""

    def apply(changes: Mapping[str, str | None]) -> None:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    before = {k: os.environ.get(k) for k in values}
    apply(values)
    try:
        yield
    finally:
        apply(before)


def local_ray_on_loopback() -> None:
    """RAY_LOCAL_ENV's settings where unset, and Ray's own copy of the loopback switch: a local Ray that this
    process starts afterwards (``ray.init()``, also Ray's own call in ``serve run``) listens on loopback only."""
    for k, v in RAY_LOCAL_ENV.items():
        os.environ.setdefault(k, v)
    from ray._private import ray_constants

    # Ray reads the loopback switch once, when ray is first imported; a module of ours that
    # imported ray earlier would otherwise make the local cluster bind a routable address.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs: Any):
    """Connect to ``address`` (or RAY_ADDRESS) or start a loopback-only local Ray.

    Under ``ray job submit`` RAY_ADDRESS is set and we join that cluster.
    """
    for k, v in RAY_LOCAL_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    local_ray_on_loopback()
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = kwargs.pop("runtime_env", {}) or {}
    env_vars = {**ray_runtime_env_vars(), **runtime_env.get("env_vars", {})}
    if address:
        return with_startup_retries(f"joining the Ray cluster at {address}",
                                    lambda: ray.init(address=address, runtime_env={**runtime_env, "env_vars": env_vars},
                                                     **kwargs),
                                    undo=ray.shutdown)
    # A local node passes its own environment on to every process it starts, so the workers' settings
    # go there instead of into the job's runtime env. A worker whose job has a runtime env starts
    # through Ray's setup_worker.py (one more interpreter and its imports, then an exec of the real
    # worker) and cannot be one the node prestarted: benchmarks/ray_start.py measured 0.90 CPU-s per
    # actor process that way against 0.52, and 6 actors ready in 2.98 s against 1.45. The rest of a
    # caller's runtime env still goes to ray.init.
    runtime_env = {k: v for k, v in runtime_env.items() if k != "env_vars"} or None
    # address="local": without it ray.init joins any cluster a `ray start` left on this machine.
    # The dashboard (on loopback, a free port) also serves the state API that Ray Train's
    # placement-group cleaner polls; without it every run logs a warning a second and
    # waits for the cleaner's timeouts when it ends.
    dashboard = kwargs.pop("include_dashboard", True)

    def start():
        options = dict(kwargs)
        if dashboard:  # a new port each attempt: a failed start's port may still be held
            options.setdefault("dashboard_host", "127.0.0.1")
            options.setdefault("dashboard_port", free_port())
        # The node's (this process's environment is restored after), with its own address: Ray Train's
        # placement-group cleaner asks the state API with no address, which looks for a GCS on the
        # machine and, with another Ray running there (a second job, another user's), raised "Found
        # multiple active Ray instances" in that actor and ended its watch. The GCS port is chosen
        # here so that every process of the node is told it (RAY_ADDRESS wins over that search).
        gcs_port = free_port(taken={options.get("dashboard_port", 0)})
        own = {GCS_PORT_VAR: str(gcs_port), "RAY_ADDRESS": f"127.0.0.1:{gcs_port}"}
        with environment({**env_vars, **local_node_env(), NODE_SETTINGS_MARK: "1", **own}):
            return ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard,
                            runtime_env=runtime_env, **options)

    context = with_startup_retries("starting a local Ray", start, undo=ray.shutdown)
    global _local_node
    _local_node = context.address_info["gcs_address"]
    # The raylet's agents outlive a killed driver by 60 s (dist_nce/cluster/reaper.py): end them with it.
    from dist_nce.cluster.reaper import reap_when_driver_dies

    reap_when_driver_dies(context.address_info["session_dir"])
    return context


# Ray start-up on a loaded machine, the one policy for every driver and node this project starts
# (jobs, the demo's driver, the tests' clusters; `ray start` heads: dist_nce/cluster/head.py).
# Ray waits a fixed time for each start-up step and gives up on a machine that is merely slow:
# * a new local node: its raylet must register with the GCS within 30 s (hard-coded in Ray 2.60's
#   node.py: "The current node timed out during startup"), which a load of 30-50 on 2 cores
#   (the test suite beside other work) can miss;
# * joining a cluster: the driver must find its node through the GCS within 60 s ("Failed to get
#   node info"), which a reachable but busy head can miss.
# Those two failures are tried again (the second try finds Ray's modules in the page cache and,
# often, the load passed), STARTUP_ATTEMPTS in all, waiting STARTUP_BACKOFF_S x attempt between
# tries; any other failure (no head at that address, a bad option) is raised at once.
STARTUP_ATTEMPTS = 3
STARTUP_BACKOFF_S = 5.0
SLOW_STARTUP = ("The current node timed out during startup", "Failed to get node info")


def slow_startup(error: BaseException) -> bool:
    """True when ``error`` (or its cause) is one of Ray's start-up timeouts (:data:`SLOW_STARTUP`)."""
    while error is not None:
        if any(s in str(error) for s in SLOW_STARTUP):
            return True
        error = error.__cause__
    return False


def with_startup_retries(what: str, start, undo=None):
    """``start()``, tried again after one of Ray's start-up timeouts (the policy above): before
    each new try, ``undo()`` (e.g. ``ray.shutdown``) runs and a half-started node is stopped."""
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        try:
            return start()
        except Exception as e:
            if attempt == STARTUP_ATTEMPTS or not slow_startup(e):
                raise
            cause = e.__cause__ or e
            print(f"{what}: Ray did not start in time ({cause}); trying again ({attempt + 1}/{STARTUP_ATTEMPTS})",
                  file=sys.stderr, flush=True)
            if undo is not None:
                undo()
            _stop_half_started_node(e)
            time.sleep(STARTUP_BACKOFF_S * attempt)


def _stop_half_started_node(error: BaseException) -> None:
    """Stop the processes (GCS, raylet, agents) of a local node whose start timed out.

    ``ray.init`` raises from inside the node's constructor, so it never records the node and
    ``ray.shutdown`` cannot stop it; left alone, the failed attempt's processes would compete
    with the next attempt until this process exits. The node object is still on the traceback.
    """
    from ray._private.node import Node

    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            return
        tb = tb.tb_next


def forget_stopped_head(port: int) -> bool:
    """Remove Ray's record of the head on 127.0.0.1:``port`` once that head is stopped.

    ``ray start`` writes its address to ``/tmp/ray/ray_current_cluster``; a head stopped by
    a signal leaves it behind, and later clients that look a cluster up there (Ray Train's
    placement-group cleaner in every local run, ``ray.init()`` without an address) wait for
    a GCS that is gone. Only a record of this very head is removed. True if removed.
    """
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path, encoding="utf-8") as f:
            recorded = f.read().strip()
    except OSError:
        return False
    if recorded.rsplit(":", 1)[-1] != str(port):
        return False
    try:
        os.remove(path)
    except OSError:
        return False
    return True


# Ports chosen here are bound later by another process (`ray start`, a Ray driver, torch.distributed),
# seconds later on a loaded machine. A port from the kernel's ephemeral range can be taken in between
# by any socket bound to port 0: every Ray process on the machine binds several. Below that range and
# above Ray's default worker ports (10002-19999) a port is taken only by someone who names it.
PORT_RANGE = (20000, 32767)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _port_range() -> tuple[int, int]:
    lo, hi = PORT_RANGE
    try:
        with open(EPHEMERAL_RANGE_FILE, encoding="ascii") as f:
            hi = min(hi, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    return lo, hi


def _bindable(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound now (it is released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that is free now and not in ``taken``, outside the ephemeral range
    (comment above); the kernel's choice (ephemeral) only if 200 random tries all find a port in use."""
    lo, hi = _port_range()
    draw = random.SystemRandom()  # not the global RNG: seeded tests in two processes would agree
    for _ in range(200 if hi >= lo else 0):
        port = draw.randint(lo, hi)
        if port not in taken and _bindable(port):
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def single_process_dist_env(port: int | None = None) -> dict[str, str]:
    """torch.distributed env for one process outside a launcher (DeepSpeed needs it)."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port or free_port()),
    }


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _import_faiss():
    """``import faiss``, without the INFO lines of its loader: it tries the library built for each
    instruction set the CPU has, best first, and logs each one the wheel lacks
    (``ModuleNotFoundError("No module named 'faiss.swigfaiss_avx512'")``), which every Ray worker
    printed at start though the next one loads as it should. Its warnings still show."""
    import logging

    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss


def require_faiss():
    """The ``faiss`` module, or an ImportError that says how to install it.

    setup.py has no faiss in install_requires: it comes from exactly one extra, ``cpu``
    (faiss-cpu) or ``gpu`` (faiss-gpu), because both packages own the same files.
    """
    try:
        faiss = _import_faiss()
    except ImportError as exc:
        raise FaissMissing(
            f"dist-nce needs FAISS for this (index.backend flat, ivf or hnsw; the torch backend needs none), "
            f"and `import faiss` failed ({exc}). It comes from exactly one "
            "setup.py extra: pip install -e '.[cpu]' (faiss-cpu) or pip install -e '.[gpu]' "
            "(faiss-gpu); scripts/install.sh (run by `make venv`) picks one. An environment that "
            "ever held both packages has a broken faiss (they own the same files): recreate it."
        ) from exc
    if not hasattr(faiss, "IndexFlatIP"):
        # What uninstalling one of faiss-cpu/faiss-gpu leaves of the other: a faiss/ folder
        # without the library, which still imports (as a namespace package).
        raise ImportError(
            f"`import faiss` found {list(getattr(faiss, '__path__', []))} without the FAISS library: "
            "faiss-cpu and faiss-gpu were both installed and one was removed, which deletes files "
            "of the other. Recreate the environment and install one extra: pip install -e '.[cpu]' "
            "or '.[gpu]' (scripts/install.sh, run by `make venv`, picks one)."
        )
    return faiss
