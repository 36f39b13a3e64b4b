"""What the machine can do right now, printed beside timings: this one's speed varies from run to run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
