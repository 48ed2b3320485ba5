"""DeviceSpan: the GPU's wall time over a span of the step, read without waiting (CUDA events)."""
from __future__ import annotations

import pytest
import torch

from dist_nce.worker.device_time import DeviceSpan


def test_on_a_cpu_every_call_is_a_no_op():
    span = DeviceSpan("cpu")
    span.start()
    torch.ones(4).sum()
    span.stop()
    assert not span.cuda and span.seconds() is None


class FakeEvent:
    """torch.cuda.Event's timing surface on a fake stream: record() stamps the clock, query() says
    whether the stream has reached the event (``done``), elapsed_time() is in milliseconds."""
    clock = 0.0
    done = True

    def __init__(self, enable_timing: bool = False):
        assert enable_timing, "a span's events must be created with timing on"
        self.at = None

    def record(self):
        self.at = FakeEvent.clock

    def query(self):
        return FakeEvent.done

    def elapsed_time(self, end):
        assert FakeEvent.done and self.at is not None and end.at is not None, "read before both completed"
        return end.at - self.at


@pytest.fixture()
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock, FakeEvent.done = 0.0, True
    return FakeEvent


def test_on_cuda_the_span_is_read_only_once_its_work_is_done(fake_cuda):
    span = DeviceSpan(torch.device("cuda", 0))
    assert span.cuda and span.seconds() is None  # not started
    fake_cuda.clock = 5.0
    span.start()
    assert span.seconds() is None  # not stopped
    fake_cuda.clock = 250.0
    span.stop()
    fake_cuda.done = False  # the optimizer's kernels still running: no answer, and no wait for one
    assert span.seconds() is None
    fake_cuda.done = True
    assert span.seconds() == pytest.approx(0.245)
    fake_cuda.clock = 300.0
    span.stop()  # a second stop keeps the first
    assert span.seconds() == pytest.approx(0.245)
    span.start()  # a new span forgets the old one
    assert span.seconds() is None
