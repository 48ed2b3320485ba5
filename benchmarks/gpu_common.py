"""The harness of the GPU benchmarks (:mod:`benchmarks.gpu` and the encode and train sections it runs,
:mod:`benchmarks.gpu_encode` and :mod:`benchmarks.gpu_train`): waiting for the device, timing a call on
it, the bf16 GEMM peak that every MFU is divided by, the device and versions their JSON records, and a
call under torch.profiler.

Each function takes a ``torch.device`` or its name, and off CUDA it runs the same steps on the CPU, so
the ``--quick --device cpu`` runs in tests/ go through the code a GPU run does. Interleaving, spreads
and comparisons come from :mod:`benchmarks.common`.
"""
from __future__ import annotations

import os
import platform
from typing import Any, Callable

import torch

from benchmarks.common import interleaved


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA): a GPU timing must do this before it reads the clock."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def synced(fn: Callable[[], Any], device: torch.device | str) -> Callable[[], None]:
    """``fn`` followed by :func:`sync`: a method for :func:`benchmarks.common.interleaved` whose time
    includes the device work it queued, not just the launches."""
    def run() -> None:
        fn()
        sync(device)
    return run


def timed(fn: Callable[[], Any], device: torch.device | str, repeats: int, warmup: int = 1) -> dict:
    """:func:`benchmarks.common.spread` of ``repeats`` calls of ``fn``, each run to completion on the
    device, after ``warmup`` untimed calls."""
    return interleaved({"x": synced(fn, device)}, repeats, warmup)["x"]


def gemm_peak(device: torch.device | str, size: int, repeats: int = 10) -> dict:
    """bf16 GEMM rate (TFLOP/s) of a size^3 product on ``device``: best and median of ``repeats`` products
    after three warm-up products. It is the denominator of every MFU the GPU benchmarks report."""
    a = torch.randn(size, size, device=device).bfloat16()
    b = torch.randn(size, size, device=device).bfloat16()
    rates = sorted(2 * size ** 3 / t / 1e12 for t in timed(lambda: a @ b, device, repeats, warmup=3)["seconds"])
    return {"size": size, "tflops_best": rates[-1], "tflops_median": rates[len(rates) // 2]}


def bf16_peak(given: float | None, device: torch.device | str, size: int, repeats: int = 10) -> tuple[float, str]:
    """(peak TFLOP/s, where it came from). A peak ``given`` by the caller is kept, so that every section of
    one run divides by the same figure. Otherwise the peak is measured here with :func:`gemm_peak`."""
    if given is not None:
        return float(given), "caller"
    return gemm_peak(device, size, repeats)["tflops_best"], f"measured here: bf16 matmul {size}^3, best of {repeats}"


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or off CUDA the host processor's."""
    return torch.cuda.get_device_name(device) if is_cuda(device) else platform.processor() or platform.machine()


def device_header(device: torch.device | str) -> dict:
    """What a gpu_encode or gpu_train result says about where it ran: the device's name and the versions
    behind the figures."""
    return {"device_name": device_name(device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "transformers": __import__("transformers").__version__}}


def device_info(device: torch.device) -> dict:
    """The ``info`` record of each ``benchmarks.gpu`` section: device, versions (Triton's too), host CPUs,
    and on CUDA the SM count and memory, off CUDA whether Triton is interpreted."""
    info = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host_cpus": os.cpu_count()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["name"] = device_name(device)
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info.update(sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return info


def profiled(fn: Callable[[], Any], device: torch.device | str):
    """One call of ``fn`` under torch.profiler (CPU activity, and CUDA's on a GPU). The device is
    synchronised inside the trace so that the kernels ``fn`` queued are in it. Returns the profiler:
    ``.events()``, ``.key_averages()``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(device) else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    return prof


def result_writer(out: str | os.PathLike | None) -> Callable[[dict], None]:
    """What a benchmark calls with its result so far after each part it finishes: written to ``out``
    (atomically, ``"complete": false``; nothing when ``out`` is None), so a device call cut at its time
    limit still brings back the parts it measured. The final write, ``"complete": true``, replaces it.
    Values JSON cannot hold are written as ``str``, as the final write does."""
    import json

    from dist_nce.core.artifacts import atomic_write_text

    def write(result: dict) -> None:
        if out is not None:
            atomic_write_text(out, json.dumps({**result, "complete": False}, indent=1, default=str))

    return write
