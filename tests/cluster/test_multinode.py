"""Several Ray nodes on this machine (separate raylets, token auth on), as on a real cluster.

``ray.cluster_utils.Cluster`` (Ray's own multi-node harness) starts a head that schedules
nothing (0 CPUs: it runs the driver, Ray Train's controller and the dashboard) and worker
nodes of two kinds, told apart by custom resources, the way a user dedicates nodes:

* three shard nodes (``kb_shard: 1``): the 2 shards ask ``service.resources={kb_shard: 1}``, so
  they land on two of them and the third is the spare a lost shard moves to;
* two trainer nodes (``trainer: 2``): the 2 Ray Train workers ask
  ``run.resources_per_worker={trainer: 1}`` and are packed on one; the other is the spare.

Every run is the deterministic tiny config (sync refresh at epoch starts), so a run that
lost a node must reproduce the undisturbed run's losses exactly (rtol 1e-5, as the
one-node test in tests/train/test_train_ray.py). The undisturbed run is the one a user
submits (``ray job submit`` of jobs/aida_finetune.py); the run that loses nodes is driven
from this process, so their equal losses also show the job and the driver train alike.
Each test fails loudly if its fault did not happen.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.worker.tb import read_metrics
from tests.train.tinyrun import losses, prepare_tiny, tiny_config, tiny_overrides, train

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.multinode]

REPO = Path(__file__).resolve().parents[2]
SHARD_NODE, TRAINER_NODE = {"kb_shard": 1}, {"trainer": 2}
PLACEMENT = ["service.resources={kb_shard: 1}", "run.resources_per_worker={trainer: 1}"]
DETERMINISTIC = ["refresh.mode=sync", "refresh.every_steps=0", "run.evaluate_before=false", "run.export=false",
                 "run.checkpoint_every_steps=3", "run.max_failures=2", *PLACEMENT]


class Nodes:
    """The cluster's worker nodes and what kind each is (kept for nodes removed since)."""

    def __init__(self, cluster):
        self.cluster, self.kinds = cluster, {}
        for _ in range(3):
            self.add("shard")
        for _ in range(2):
            self.add("trainer")
        cluster.wait_for_nodes()

    def add(self, kind: str):
        from dist_nce.cluster.runtime import free_port, with_startup_retries

        # Each node unpacks a job's working_dir into a directory of its own, as on separate
        # machines: sharing one, a node re-extracting the package pulls the files (and the
        # working directory) from under the processes of another.
        node = with_startup_retries(f"adding a {kind} node", lambda: self.cluster.add_node(
            num_cpus=1, resources=SHARD_NODE if kind == "shard" else TRAINER_NODE,
            runtime_env_dir_name=f"runtime_resources_{len(self.kinds)}", dashboard_agent_listen_port=free_port()))
        self.kinds[node.node_id] = kind
        return node

    def remove(self, node_id: str) -> None:
        """Kill the node's raylet and every process on it, as when a machine is lost."""
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def kind(self, node_id: str) -> str:
        return self.kinds.get(node_id, "head")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head + 3 shard nodes + 2 trainer nodes, token auth on; the driver is this process."""
    import ray
    from ray.cluster_utils import Cluster

    from dist_nce.cluster.runtime import enable_token_auth, free_port, init_ray, with_startup_retries

    if ray.is_initialized():  # the session's one-node Ray (tests/conftest.py); it restarts for later modules
        ray.shutdown()
    enable_token_auth()  # as ray.init does for a local cluster; kept on for the rest of the session
    # A job's entrypoint `python` is found on the PATH of the head that runs it: this venv's.
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    dash = free_port()
    head = with_startup_retries("starting the head", lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dash,
        # Every node's dashboard agent on its own free port: the default (52365) is taken by any other
        # Ray on this machine (a concurrent test worker's), and a head whose agent cannot bind has no
        # job agent: every `ray job submit` then fails with "No available agent" (seen under xdist).
        "dashboard_agent_listen_port": free_port(),
        # A lost node is declared dead after ~3 s instead of the default ~15 s.
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                           "health_check_failure_threshold": 3}}))
    try:
        nodes = Nodes(head)
        init_ray(address=head.address)
        yield nodes, f"http://127.0.0.1:{dash}"
    finally:
        ray.shutdown()
        head.shutdown()


@pytest.fixture(scope="module")
def kb(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("multinode_kb")
    prepare_tiny(root, tiny_model_dir)
    return root


class NodeRemover(threading.Thread):
    """Removes the node ``pick()`` names (its raylet and every process on it, as a lost machine)
    once the run has logged ``after`` steps. ``pick_after``: how many logged steps ``pick()`` waits
    for (default ``after``); picking early leaves only the removal itself between step ``after`` and
    the node's loss (on a loaded machine the state API can take seconds, while the run trains on)."""

    def __init__(self, nodes: Nodes, metrics: Path, after: int, pick, pick_after: int | None = None):
        super().__init__(daemon=True)
        self.nodes, self.metrics, self.after, self.pick = nodes, metrics, after, pick
        self.pick_after = after if pick_after is None else pick_after
        self.removed: str | None = None
        self.logged_at_removal: int | None = None  # steps logged when the node was gone
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self):
        try:
            deadline = time.monotonic() + 900
            node_id = None
            while time.monotonic() < deadline and not self.stop.is_set():
                logged = len(read_metrics(self.metrics)) if self.metrics.exists() else 0
                if node_id is None and logged >= self.pick_after:
                    node_id = self.pick()
                if node_id is not None and logged >= self.after:
                    self.nodes.remove(node_id)
                    self.removed = node_id
                    self.logged_at_removal = len(read_metrics(self.metrics))
                    return
                time.sleep(0.1)
        except BaseException as e:  # surfaced by the test
            self.error = e


def live_nodes(class_name: str) -> set[str]:
    """The nodes of the live actors of a class, from Ray's state API (any job's, any namespace)."""
    from ray.util.state import list_actors

    return {a.node_id for a in list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])}


def train_worker_nodes() -> set[str]:
    return live_nodes("RayTrainWorker")


def submit(address: str, out: Path, kb: Path, tiny_model_dir: str, storage: Path, *sets: str):
    """``ray job submit`` of jobs/aida_finetune.py on the tiny config, as a user types it against a cluster."""
    sets = (*tiny_overrides(kb, tiny_model_dir), f"run.output_dir={out}", f"run.storage_path={storage}", *sets)
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
           "--", "python", "jobs/aida_finetune.py", "--config", "configs/aida/test_tiny.yaml",
           *[x for s in sets for x in ("--set", s)]]
    for _ in range(30):  # the head's job agent comes up a little after the head itself
        r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
        if "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(2)
    return r


@pytest.fixture(scope="module")
def reference(cluster, kb, tiny_model_dir, tmp_path_factory):
    """The undisturbed run, submitted with ``ray job submit`` as a user runs it on a cluster, and
    the nodes its shards and trainers ran on (read from Ray's state API once it has logged a step)."""
    _, address = cluster
    root = tmp_path_factory.mktemp("reference")
    out = root / "out"
    metrics = out / "metrics.jsonl"
    seen: dict[str, set[str]] = {}
    done = threading.Event()

    def look():
        while not done.is_set():
            if metrics.exists() and read_metrics(metrics):
                seen["shards"], seen["trainers"] = live_nodes("EntityShard"), train_worker_nodes()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    r = submit(address, out, kb, tiny_model_dir, root / "ray", *DETERMINISTIC)
    done.set()
    watcher.join()
    (root / "submit.log").write_text(r.stdout + r.stderr)
    assert r.returncode == 0 and "succeeded" in r.stdout + r.stderr, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    loss = {s: v["train/loss"] for s, v in read_metrics(metrics).items() if "train/loss" in v}
    return summary, loss, seen


def test_ray_job_submit_places_shards_on_shard_nodes_and_trainers_on_another(cluster, reference):
    """What a user types against a cluster: the job trains and evaluates, its 2 shards land on 2
    shard nodes and its 2 Ray Train workers, packed, on one trainer node."""
    nodes, _ = cluster
    summary, loss, seen = reference
    assert summary["done"] and summary["step"] == 24 and sorted(loss) == list(range(24))
    assert summary["dev_after"]["n_mentions"] == 32
    assert len(seen.get("shards", ())) == 2 and {nodes.kind(n) for n in seen["shards"]} == {"shard"}, seen
    assert len(seen.get("trainers", ())) == 1, seen
    assert nodes.kind(next(iter(seen["trainers"]))) == "trainer"


def test_sharded_answers_equal_one_node_answers(cluster, kb, tiny_model_dir, tmp_path):
    """The 2 shards on 2 nodes answer top-k and the exact hard sample exactly as 1 shard does."""
    import dataclasses

    import ray

    from dist_nce.actors.service import NegativeService
    from dist_nce.train.model import build_retriever

    cfg = tiny_config(kb, tiny_model_dir, tmp_path, *DETERMINISTIC, "service.index.backend=torch")
    state = ray.put(build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state())
    one_cfg = dataclasses.replace(cfg.service, num_shards=1, shard_dir=str(tmp_path / "one"))
    two_cfg = dataclasses.replace(cfg.service, shard_dir=str(tmp_path / "two"))
    services = [NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, c, cfg.run.output_dir)
                for c in (one_cfg, two_cfg)]
    try:
        one, two = services
        for s in services:
            assert s.ensure_encoded(state) == 0
        assert len({s["node"] for s in two.status()}) == 2
        q = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        gold = torch.tensor([0, 5, 199, 200, 201, 399, 17, 250])
        a, b = one.topk(q, 16, gold=gold).result(), two.topk(q, 16, gold=gold).result()
        assert torch.equal(a.ids, b.ids) and torch.allclose(a.scores, b.scores, rtol=1e-6, atol=1e-6)
        keys = torch.arange(8)
        a = one.mine(q, gold, n_hard=7, n_random=0, seed=3, query_keys=keys).result()
        b = two.mine(q, gold, n_hard=7, n_random=0, seed=3, query_keys=keys).result()
        assert torch.equal(a.negatives.ids, b.negatives.ids)
        assert not (a.negatives.ids == gold[:, None]).any()
    finally:
        for s in services:
            s.shutdown()


def test_a_lost_shard_node_and_a_lost_trainer_node_cost_nothing(cluster, reference, kb, tiny_model_dir, tmp_path):
    """One run loses the node holding shard 1 (after 6 steps) and then the node running the Ray
    Train workers (after 10). Ray restarts the shard on the spare shard node, where it reloads
    its persisted version; Ray Train restarts the group on the spare trainer node from the last
    checkpoint; the run ends with exactly the undisturbed run's losses."""
    nodes, _ = cluster
    cfg = tiny_config(kb, tiny_model_dir, tmp_path, *DETERMINISTIC)
    metrics = Path(cfg.run.output_dir) / "metrics.jsonl"
    before: dict[str, list[dict]] = {}
    removers: list[NodeRemover] = []

    def start(service):
        before["status"] = service.status()
        # The trainer node is picked once training runs (it does not move until it is lost) and removed
        # with 14 of the 24 steps left: a loaded machine trains several steps while a node goes down, and
        # one removed after the last step would cost nothing to see.
        removers.extend([NodeRemover(nodes, metrics, after=6, pick=lambda: before["status"][1]["node"]),
                         NodeRemover(nodes, metrics, after=10, pick=lambda: next(iter(train_worker_nodes())),
                                     pick_after=1)])
        for r in removers:
            r.start()

    final, status = train(cfg, during=start)
    for r in removers:
        r.stop.set()
        assert r.error is None, r.error
    shard_loss, trainer_loss = removers
    nodes.add("shard")  # spares again, for the tests after this one
    nodes.add("trainer")
    # the shard node: shard 1 moved to the spare shard node, a new process; shard 0 never moved
    assert shard_loss.removed == before["status"][1]["node"], "no shard node was removed during training"
    assert status[1]["node"] != before["status"][1]["node"] and nodes.kind(status[1]["node"]) == "shard"
    assert status[1]["pid"] != before["status"][1]["pid"] and status[0]["node"] == before["status"][0]["node"]
    # the trainer node: logged steps run in order but for one jump back, to a checkpoint (every
    # 3 steps and at each 4-step epoch's end), from which the group trained the steps again
    assert trainer_loss.removed is not None and nodes.kind(trainer_loss.removed) == "trainer", \
        "no trainer node was removed during training"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
             if "train/loss" in json.loads(line)]
    back = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
    assert len(back) == 1, (f"expected one restart from a checkpoint, steps were {steps}; the trainer node was "
                            f"gone with {trainer_loss.logged_at_removal} steps logged")
    restart = steps[back[0]]
    assert (restart % 3 == 0 or restart % 4 == 0) and 0 < restart <= steps[back[0] - 1], steps
    # and nothing changed: every loss equals the undisturbed run's
    assert final["done"] and final["step"] == 24
    loss, ref = losses(cfg), reference[1]
    assert sorted(loss) == list(range(24))
    np.testing.assert_allclose([loss[s] for s in range(24)], [ref[s] for s in range(24)], rtol=1e-5)
