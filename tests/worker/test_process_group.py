"""The training workers' torch.distributed group on a real local Ray: it works, and no worker
listens on a routable address (torch binds a TCPStore to every interface)."""
from __future__ import annotations

import json

import pytest

from dist_nce.worker.process_group import is_loopback


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.7", "192.0.2.2", "::ffff:10.0.0.7", "node-1"]))


@pytest.mark.slow
@pytest.mark.ray
def test_two_workers_meet_without_a_routable_listener(ray_local, tmp_path):
    """Two Ray Train workers form the gloo group listening on loopback only. The same run checks
    ``fit_and_release`` (worker.launch), which every job's fit goes through: the run's TrainController
    ends after it, where Ray Train's SIGINT handler kept it alive."""
    import signal
    import time

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.state import list_actors

    from dist_nce.worker.launch import fit_and_release
    from dist_nce.worker.process_group import LocalGroupTorchConfig

    def _group_body(config: dict) -> None:  # nested: pickled by value for the workers
        import json
        import os

        import psutil
        import torch
        import torch.distributed as dist

        from dist_nce.worker.process_group import is_loopback

        rank = dist.get_rank()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # 1 + 2
        me = psutil.Process()
        listening = [c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        routable = [ip for ip in listening if not is_loopback(ip)]
        seen = {"world": dist.get_world_size(), "sum": total.item(), "listening": listening,
                "routable": routable, "iface": os.environ.get("GLOO_SOCKET_IFNAME", "")}
        with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)

    trainer = TorchTrainer(_group_body, train_loop_config={"out": str(tmp_path)}, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                           torch_config=LocalGroupTorchConfig(backend="gloo"),
                           run_config=RunConfig(name="pg", storage_path=str(tmp_path)))
    handler = signal.getsignal(signal.SIGINT)
    assert fit_and_release(trainer).error is None
    assert signal.getsignal(signal.SIGINT) is handler

    def controllers():
        # this cluster's state API by its address: autodetection refuses to choose between local clusters
        return list_actors(address=ray_local, filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")])

    deadline = time.monotonic() + 60  # the actor's exit is asynchronous; ~1 s here
    while controllers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not controllers()
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["world"], seen["sum"], seen["iface"]) == (2, 3.0, "lo"), seen
        assert seen["listening"] and seen["routable"] == [], seen  # gloo's pairs listen, on loopback


class _FakeLocalGroup:
    """What LocalGroupBackend.on_start asks of a Ray Train worker group, all workers on loopback."""

    def __init__(self):
        self.joined: list[dict] = []

    def __len__(self) -> int:
        return 2

    def get_resources_per_worker(self) -> dict:
        return {"CPU": 1}

    def execute_single(self, rank, fn, *args, **kwargs):
        return "127.0.0.1", 29500

    def execute(self, fn, *args, **kwargs):
        return None

    def execute_single_async(self, rank, fn, **kwargs):
        self.joined.append(kwargs)
        return None


def test_a_groups_store_file_is_removed_on_restart_and_on_a_failed_shutdown(tmp_path, monkeypatch):
    """torch leaves the FileStore's file when a rank dies; Ray Train aborts a failed group without
    shutting it down, and a shutdown with a dead worker raises: neither may leave the file in /tmp.
    Nor may a killed controller, which never shuts its group down: the next group removes its file."""
    import subprocess
    import sys

    import ray
    from ray.train.torch.config import _TorchBackend

    from dist_nce.core.scratch import scratch_name
    from dist_nce.worker.process_group import STORE_PREFIX, LocalGroupBackend, LocalGroupTorchConfig

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    orphan = tmp_path / f"{scratch_name(STORE_PREFIX, killed.pid)}{'0' * 32}"
    orphan.write_bytes(b"store")
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the fake group's joins return nothing to wait on
    backend, config, group = LocalGroupBackend(), LocalGroupTorchConfig(backend="gloo"), _FakeLocalGroup()
    backend.on_start(group, config)
    first = group.joined[0]["store_path"]
    assert {j["store_path"] for j in group.joined} == {first} and first.startswith(str(tmp_path))
    assert not orphan.exists()
    open(first, "w").close()  # what torch's FileStore left when a rank was killed
    backend.on_start(group, config)  # Ray Train restarts the group (the failed one was aborted)
    second = group.joined[-1]["store_path"]
    assert second != first and not (tmp_path / first).exists()
    open(second, "w").close()

    def dead_worker(self, worker_group, backend_config):
        raise RuntimeError("the actor died")

    monkeypatch.setattr(_TorchBackend, "on_shutdown", dead_worker)
    with pytest.raises(RuntimeError, match="died"):
        backend.on_shutdown(group, config)
    assert list(tmp_path.iterdir()) == []
