"""What the machine can do right now, printed beside timings: this one's speed varies from run to run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """The machine's fp32 matmul rate now (median of `repeats`), to read the timings beside."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def least_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The least wall seconds of `repeats` calls of `fn`: the figure least disturbed by whatever
    else the machine ran meanwhile."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def single_thread_gflops() -> float:
    """The fp32 matmul rate of one core (the figure docs/benchmarks.md quotes beside serving runs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_gflops()
    finally:
        torch.set_num_threads(threads)


def sync(device: torch.device) -> None:
    """Until `device` is done with what was queued on it (a GPU's work runs behind the host)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The least wall seconds of `repeats` runs of `fn`, each until the device is done with it,
    after one warm-up run."""

    def synced() -> None:
        fn()
        sync(device)

    synced()
    return least_seconds(synced, repeats)


def device_rates(device: torch.device, dtype: torch.dtype, small: bool = False) -> dict:
    """The device's memory bandwidth (read + write of a large copy), host↔device through pinned
    memory (on a GPU), and its dense matmul rate in `dtype`: the ceilings GPU figures are read
    against. `small`: sizes for a CPU rehearsal."""
    import torch

    n_bytes = (64 if small else 2048) << 20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = device_seconds(lambda: dst.copy_(src), device)
    out = {"memory_gbps": round(2 * n_bytes / copy / 1e9, 1)}  # each byte read once and written once
    if device.type == "cuda":
        host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
        up = device_seconds(lambda: src.copy_(host, non_blocking=True), device)
        down = device_seconds(lambda: host.copy_(src, non_blocking=True), device)
        out["host_to_device_gbps"] = round(n_bytes / up / 1e9, 1)
        out["device_to_host_gbps"] = round(n_bytes / down / 1e9, 1)
    n = 1024 if small else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out["matmul_tflops"] = round(2 * n**3 / device_seconds(lambda: a @ b, device) / 1e12, 3)
    return out
