"""Reusable host buffers for transfers.

Per-request buffers cost twice: fresh pages fault in as the data lands (~10 ms for 64 MB here),
and RDMA transports must register new memory with the NIC (tens of ms). UCX caches
registrations by address, so handing the same buffers out again makes both costs one-time.
Buffers come in power-of-two size classes, page-aligned, and are touched once at allocation.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from common.protocol.tensors import nbytes_of, torch_dtype

PAGE = 4096
MIN_CLASS = 64 * 1024


def size_class(nbytes: int) -> int:
    """The capacity a request of `nbytes` gets: the next power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


class PoolBuffer:
    """A buffer lent by a pool. Use `view()` for a typed tensor over it; `release()` returns it.

    Views share the memory: nothing may use them after `release()`.
    """

    def __init__(self, pool: BufferPool | None, storage: torch.Tensor, nbytes: int) -> None:
        self._pool = pool
        self.storage = storage  # uint8 [capacity], page-aligned
        self.nbytes = nbytes
        self.released = False

    @property
    def capacity(self) -> int:
        return self.storage.numel()

    @property
    def data(self) -> torch.Tensor:
        """The first `nbytes` bytes as uint8."""
        return self.storage[: self.nbytes]

    def view(self, shape: tuple[int, ...], dtype: str | torch.dtype) -> torch.Tensor:
        """The first bytes as a tensor of `shape` and `dtype` (which must fit in `nbytes`)."""
        dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        need = nbytes_of(tuple(shape), str(dt).removeprefix("torch."))
        if need > self.nbytes:
            raise ValueError(
                f"a {dt} tensor of shape {tuple(shape)} needs {need} bytes; buffer has {self.nbytes}"
            )
        return self.storage[:need].view(dt).reshape(shape)

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self._pool is not None:
                self._pool._give_back(self)


@dataclass
class PoolStats:
    allocated: int = 0  # buffers created
    reused: int = 0  # acquisitions served from the free lists
    cached_bytes: int = 0  # bytes sitting in free lists


class BufferPool:
    """Thread-safe free lists per size class, holding at most `max_cached_bytes` idle."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.stats = PoolStats()

    def acquire(self, nbytes: int) -> PoolBuffer:
        """A buffer of at least `nbytes` (contents undefined)."""
        capacity = size_class(nbytes)
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self.stats.reused += 1
                self.stats.cached_bytes -= capacity
                return PoolBuffer(self, free.pop(), nbytes)
            self.stats.allocated += 1
        return PoolBuffer(self, _aligned(capacity), nbytes)

    def warm(self, nbytes: int, count: int = 1) -> None:
        """Allocate buffers ahead of need (e.g. at start-up for the expected transfer sizes)."""
        for buf in [self.acquire(nbytes) for _ in range(count)]:
            buf.release()

    def _give_back(self, buf: PoolBuffer) -> None:
        with self._lock:
            if self.stats.cached_bytes + buf.capacity <= self.max_cached_bytes:
                self._free[buf.capacity].append(buf.storage)
                self.stats.cached_bytes += buf.capacity

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.stats.cached_bytes = 0


def _aligned(capacity: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of `capacity` bytes, its pages already faulted in."""
    raw = torch.empty(capacity + PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % PAGE
    storage = raw[offset : offset + capacity]
    storage.zero_()  # touch every page now, not while a transfer writes into it
    return storage
