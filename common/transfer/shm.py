"""CPU tensors copied into anonymous shared memory, which a puller on the same host maps to copy from.

For each same-host pull of a CPU tensor the owner copies it into a memfd (`memfd_create`: shared
memory with no name) lent to that puller alone, which opens it through `/proc/<owner pid>/fd/<fd>`.
Nothing is ever named in /dev/shm, so nothing can be left behind there: the kernel frees the memory
once the owner has closed the descriptor and the last mapping is gone, whichever process dies first
and however. A random token in the memfd's name lets the puller check that the descriptor it
opened is the segment it was told of (not a file that took over the number).

Segments are reused (`SegmentPool`): a fresh memfd's pages cost ~10 ms per 16 MiB to allocate,
a warm one's copy 0.4 ms. One goes back to the pool when its lease ends: after its reader's
acknowledgement (it has unmapped it), or once the reader is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable

import torch

from common.transfer.pool import size_class

PREFIX = "trident-"  # memfds show as "/memfd:trident-<token> (deleted)" in /proc/*/fd and /proc/*/maps


class Segment:
    """A memfd of `capacity` bytes, mapped here (`data`); `nbytes` of it are lent now. Counted:
    each hold (a lease) adds one; the last `drop()` gives it back to its pool, or closes it."""

    def __init__(self, capacity: int, pool: SegmentPool | None = None) -> None:
        self.token = uuid.uuid4().hex
        self.capacity = capacity
        self.nbytes = 0
        self._pool = pool
        self.fd = os.memfd_create(PREFIX + self.token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(1, capacity))
            # Mapped by torch (a storage that unmaps itself once its last tensor is gone, keeping no
            # descriptor of its own), through the memfd's /proc link.
            self.data: torch.Tensor | None = torch.from_file(
                f"/proc/self/fd/{self.fd}", shared=True, size=max(1, capacity), dtype=torch.uint8
            )
        except BaseException:
            os.close(self.fd)
            raise
        self._refs = 1
        self._lock = threading.Lock()

    def fill(self, tensor: torch.Tensor) -> None:
        """Copy a contiguous CPU tensor in (its bytes are what is lent)."""
        assert self.data is not None
        self.nbytes = tensor.numel() * tensor.element_size()
        if self.nbytes:
            self.data[: self.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))

    def describe(self) -> dict[str, object]:
        """What a same-host puller needs to map it (the `x` of a host-local reply)."""
        return {"k": "fd", "pid": os.getpid(), "fd": self.fd, "tok": self.token, "n": self.nbytes}

    def hold(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("segment already given up")
            self._refs += 1

    def drop(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last and (self._pool is None or not self._pool.give_back(self)):
            self.close()

    def close(self) -> None:
        os.close(self.fd)  # a puller that mapped it keeps its mapping; no new one can open it
        self.data = None  # unmapped here once no tensor over it is left either


class SegmentPool:
    """Idle segments by size class (pool.py's), at most `max_cached_bytes` of them."""

    def __init__(self, max_cached_bytes: int) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[Segment]] = defaultdict(list)
        self._cached = 0
        self._closed = False
        self._lock = threading.Lock()

    def copy_of(self, tensor: torch.Tensor) -> Segment:
        """A segment holding a copy of a contiguous CPU tensor, held once (by the caller)."""
        capacity = size_class(tensor.numel() * tensor.element_size())
        with self._lock:
            free = self._free.get(capacity)
            segment = free.pop() if free else None
            if segment is not None:
                self._cached -= capacity
                segment._refs = 1
        segment = segment or Segment(capacity, self)
        segment.fill(tensor)
        return segment

    def give_back(self, segment: Segment) -> bool:
        with self._lock:
            if self._closed or self._cached + segment.capacity > self.max_cached_bytes:
                return False
            self._free[segment.capacity].append(segment)
            self._cached += segment.capacity
            return True

    @property
    def idle(self) -> int:
        """Segments kept for reuse now."""
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def close(self) -> None:
        """Close the idle segments; those lent now close when their leases end."""
        with self._lock:
            self._closed = True
            idle = [s for free in self._free.values() for s in free]
            self._free.clear()
            self._cached = 0
        for segment in idle:
            segment.close()


def read_into(
    desc: dict,
    dest: torch.Tensor | Callable[[torch.Tensor], None],
    on_mapped: Callable[[], None] | None = None,
) -> None:
    """Copy a segment another process described (`Segment.describe`) into `dest` (flat uint8, CPU
    or CUDA), or hand its mapped bytes (flat uint8) to `dest(source)` to copy where it wants (a
    Sink's write; no view of them may outlive the call). Raises OSError when it cannot be opened
    from here (another pid namespace, no permission, the owner gone). Nothing of it stays open once
    this returns, whatever happens. `on_mapped`: for tests, called once it is open."""
    pid, fd, token, nbytes = int(desc["pid"]), int(desc["fd"]), str(desc["tok"]), int(desc["n"])
    if isinstance(dest, torch.Tensor) and dest.numel() != nbytes:
        raise OSError(f"segment holds {nbytes} bytes; the destination {dest.numel()}")
    if nbytes == 0:
        return
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Checked on what was opened, not on the path: the number may have been reused meanwhile.
        if PREFIX + token not in os.readlink(f"/proc/self/fd/{handle}"):
            raise OSError(f"/proc/{pid}/fd/{fd} is not the segment it was said to be")
        if os.fstat(handle).st_size < nbytes:
            raise OSError("the segment is smaller than said")
        if on_mapped is not None:
            on_mapped()
        if not isinstance(dest, torch.Tensor):
            _map_and_write(handle, nbytes, dest)
        elif dest.device.type == "cpu":
            _read(handle, memoryview(dest.numpy()))  # one kernel copy, no mapping to fault in
        else:
            _map_and_write(handle, nbytes, dest.copy_)
    finally:
        os.close(handle)


def _read(handle: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(handle, [view[done:]], done)
        if got <= 0:
            raise OSError(f"the segment ended after {done} of {len(view)} bytes")
        done += got


def _map_and_write(handle: int, nbytes: int, write: Callable[[torch.Tensor], None]) -> None:
    """`write(source)` over a mapping of the segment (private and writable, as torch wants a
    writable buffer; nothing is written, so nothing is copied): into device memory, or scattered
    into KV blocks, in one copy."""
    mapped = mmap.mmap(handle, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    source = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
    try:
        write(source)
    finally:
        del source  # no view may outlive the mapping
        # A view still held (by a failed write's traceback) keeps the mapping until it goes.
        with contextlib.suppress(BufferError):
            mapped.close()


def open_segments(pid: int | str = "self") -> list[str]:
    """The memfds of ours a process holds open (`/proc/<pid>/fd`): what a test checks is empty."""
    found: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:" + PREFIX):
            found.add(target)
    return sorted(found)


def mapped_segments(pid: int | str = "self") -> list[str]:
    """The memfds of ours a process has mapped (`/proc/<pid>/maps`)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({line.split(None, 5)[-1].strip() for line in f if "/memfd:" + PREFIX in line})
    except OSError:
        return []
