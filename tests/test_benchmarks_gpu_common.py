"""benchmarks/gpu_common.py, the GPU benchmarks' harness, on the CPU: each timed call ends with a device
sync, the peak is the rate of the fastest product, a caller's peak is kept, the device records say what
torch says, and the profiler sees the call."""
from __future__ import annotations

import platform

import pytest
import torch

from benchmarks import gpu_common


def test_timed_syncs_after_every_call_warm_up_included(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_common, "sync", lambda device: calls.append(("sync", str(device))))
    out = gpu_common.timed(lambda: calls.append("fn"), "cpu", repeats=3, warmup=2)
    assert calls == ["fn", ("sync", "cpu")] * 5
    assert out["repeats"] == 3 and out["min"] <= out["median"] <= out["max"]


def test_gemm_peak_is_the_rate_of_the_fastest_product(monkeypatch):
    seen = {}

    def fake_timed(fn, device, repeats, warmup):
        seen.update(repeats=repeats, warmup=warmup, product=fn())
        return {"seconds": [4e-3, 1e-3, 2e-3, 8e-3]}
    monkeypatch.setattr(gpu_common, "timed", fake_timed)
    peak = gpu_common.gemm_peak("cpu", 64, repeats=4)
    flops = 2 * 64 ** 3
    assert seen["repeats"] == 4 and seen["warmup"] == 3
    assert seen["product"].shape == (64, 64) and seen["product"].dtype == torch.bfloat16
    assert peak == {"size": 64, "tflops_best": pytest.approx(flops / 1e-3 / 1e12),
                    "tflops_median": pytest.approx(flops / 2e-3 / 1e12)}  # rates sorted: the 3rd of 4


def test_a_caller_peak_is_kept_and_a_measured_one_says_so():
    assert gpu_common.bf16_peak(770, "cpu", 8192) == (770.0, "caller")
    peak, source = gpu_common.bf16_peak(None, "cpu", 32, repeats=2)
    assert peak > 0 and source == "measured here: bf16 matmul 32^3, best of 2"


def test_device_records_on_the_cpu():
    name = platform.processor() or platform.machine()
    header = gpu_common.device_header(torch.device("cpu"))
    assert header["device_name"] == name and header["versions"]["torch"] == torch.__version__
    info = gpu_common.device_info(torch.device("cpu"))
    assert info["name"] == name and info["device"] == "cpu" and "triton_interpret" in info
    assert "sm_count" not in info and list(info)[:6] == ["device", "torch", "cuda", "python", "host_cpus", "triton"]


def test_profiled_sees_the_call():
    a = torch.randn(16, 16)
    names = {e.name for e in gpu_common.profiled(lambda: a @ a, "cpu").events()}
    assert "aten::matmul" in names or "aten::mm" in names
