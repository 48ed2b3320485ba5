"""torch.distributed helpers for the training workers; each is a no-op for a single process,
so the same worker code runs under Ray Train and in one process (tests, benchmarks)."""
from __future__ import annotations

from typing import Any

import torch


class Collectives:
    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device

    @property
    def dist(self):
        import torch.distributed as dist

        return dist if self.world > 1 and dist.is_available() and dist.is_initialized() else None

    def barrier(self) -> None:
        if self.dist:
            self.dist.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.dist:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.dist:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean of ``values`` over the ranks."""
        if not self.dist:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return (t / self.world).tolist()
