"""How long the device took over a span of a training step, read without a host synchronisation.

A step's host clock stops when the optimizer step's kernels are queued, not when they finish: on a GPU
the rest of the step's work is then waited for by whatever reads the device next (the next batch's
mention encode for mining, the logged loss). :class:`DeviceSpan` records a CUDA event at each end of
the span on the current stream and reads their distance only once both have completed (after the
step's one read-back), so it adds no wait.

The distance is the device's wall time from reaching the span's first kernel to finishing its last,
not its busy time: it also holds the gaps in which the GPU waited for the host to queue kernels, and
the time it gave to other processes' kernels (the shards' mining and refresh). Read it against the
host's span: a device span well past the host's means the host ran ahead and the GPU was the limit; one
about equal to the host's means the GPU kept up and the host was. Work the engine puts on other
streams (ZeRO's overlapped communication) is counted only where the current stream waits for it.
"""
from __future__ import annotations

from typing import Any

import torch


class DeviceSpan:
    """``start()`` ... ``stop()`` around host code that queues device work; ``seconds()`` afterwards.

    On a device other than CUDA every call is a no-op and ``seconds()`` is None.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[Any] = []

    def _record(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append(event)

    def start(self) -> None:
        self._events = []
        if self.cuda:
            self._record()

    def stop(self) -> None:
        if self.cuda and len(self._events) == 1:
            self._record()

    def seconds(self) -> float | None:
        """Device seconds between start and stop; None on a CPU, for a span not both started and
        stopped, or while its work is still running (never waits for it)."""
        if len(self._events) != 2 or not self._events[1].query():
            return None
        return self._events[0].elapsed_time(self._events[1]) / 1e3
