"""How the training workers form their torch.distributed group.

Ray Train's torch backend starts the group with a TCPStore on worker 0, and torch binds that
store to every interface whatever address it is given (both the libuv and the classic
server): an unauthenticated key-value server reachable from the network for the whole run.
When worker 0's node address is loopback, every worker is on this machine (a loopback
address cannot be reached from another one; the several nodes of tests/cluster share it
too), so the group meets through a FileStore in the machine's temp directory instead, and
gloo's pairs are bound to the loopback interface: nothing listens on a routable address.
A group spanning real machines (a routable worker 0) is set up by Ray Train unchanged.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import timedelta

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from dist_nce.core.scratch import scratch_file_path

STORE_PREFIX = "dist_nce_group_"  # the FileStores' names in the temp directory


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for names and other addresses."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address == "localhost"
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def loopback_interface() -> str | None:
    """Name of the interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), if any."""
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def join_local_group(backend: str, world_rank: int, world_size: int, store_path: str, timeout_s: float) -> None:
    """In a worker: join the group through the FileStore at ``store_path`` (all ranks the same
    path, a new one per group: torch removes it when the last rank leaves)."""
    import torch.distributed as dist

    if backend == "gloo" and (iface := loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    dist.init_process_group(backend=backend, init_method=f"file://{store_path}", rank=world_rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


class LocalGroupBackend(_TorchBackend):
    """Ray Train's torch backend, with the FileStore rendezvous when worker 0 is on loopback."""

    def on_start(self, worker_group, backend_config) -> None:
        import ray
        from ray.train._internal.utils import get_address_and_port
        from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
        from ray.train.torch.config import _set_torch_distributed_env_vars

        address, port = worker_group.execute_single(0, get_address_and_port)
        if not is_loopback(address):
            return super().on_start(worker_group, backend_config)
        backend = backend_config.backend or ("nccl" if worker_group.get_resources_per_worker().get("GPU", 0)
                                              else "gloo")
        self._remove_store()  # a restarted group's predecessor: an aborted group is not shut down
        # A killed controller leaves its store file; the next group started on this machine removes it.
        store_path = self._store_path = scratch_file_path(STORE_PREFIX)

        def set_env(addr: str, port: int) -> None:  # read by libraries that expect a launcher's env
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)

        worker_group.execute(set_env, addr=address, port=port)
        if not isinstance(worker_group, V1WorkerGroup):
            worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(i, join_local_group, backend=backend, world_rank=i,
                                                   world_size=len(worker_group), store_path=store_path,
                                                   timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config) -> None:
        try:  # raises when a worker is already dead (Ray Train logs it and goes on)
            super().on_shutdown(worker_group, backend_config)
        finally:
            self._remove_store()

    def _remove_store(self) -> None:
        """torch leaves the FileStore's file behind when a rank exits without leaving the group."""
        path, self._store_path = getattr(self, "_store_path", None), None
        if path:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


@dataclass
class LocalGroupTorchConfig(TorchConfig):
    """``TorchConfig`` whose workers meet without a network listener when all are on this machine."""

    @property
    def backend_cls(self):
        return LocalGroupBackend
