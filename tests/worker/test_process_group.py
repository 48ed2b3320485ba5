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
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

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
    assert trainer.fit().error is None
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["world"], seen["sum"], seen["iface"]) == (2, 3.0, "lo"), seen
        assert seen["listening"] and seen["routable"] == [], seen  # gloo's pairs listen, on loopback
