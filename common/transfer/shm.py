"""CPU tensors in anonymous shared memory, which a puller on the same host maps to copy from.

The owner keeps a served CPU tensor in a memfd (`memfd_create`: shared memory with no name), and a
puller opens it through `/proc/<owner pid>/fd/<fd>`. Nothing is ever named in /dev/shm, so nothing
can be left behind there: the kernel frees the memory once the owner has closed the descriptor and
the last mapping is gone, whichever process dies first and however. A random token in the memfd's
name lets the puller check that the descriptor it opened is the segment it was told of (not a file
that took over the number).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections.abc import Callable

import torch

PREFIX = "trident-"  # memfds show as "/memfd:trident-<token> (deleted)" in /proc/*/fd and /proc/*/maps


class Segment:
    """A memfd holding `nbytes`, mapped here; `data` is its memory as uint8. Counted: the entry that
    serves it holds one reference and each open lease another; the last `drop()` closes it."""

    def __init__(self, nbytes: int) -> None:
        self.token = uuid.uuid4().hex
        self.nbytes = nbytes
        self.fd = os.memfd_create(PREFIX + self.token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(1, nbytes))
            # Mapped by torch (a storage that unmaps itself once its last tensor is gone, keeping no
            # descriptor of its own), through the memfd's /proc link.
            self.data = torch.from_file(
                f"/proc/self/fd/{self.fd}", shared=True, size=max(1, nbytes), dtype=torch.uint8
            )[:nbytes]
        except BaseException:
            os.close(self.fd)
            raise
        self._refs = 1
        self._lock = threading.Lock()

    @classmethod
    def holding(cls, tensor: torch.Tensor) -> tuple[Segment, torch.Tensor]:
        """A segment with a copy of a contiguous CPU tensor, and the tensor's view over it."""
        segment = cls(tensor.numel() * tensor.element_size())
        if segment.nbytes:
            segment.data.copy_(tensor.reshape(-1).view(torch.uint8))
        return segment, segment.data.view(tensor.dtype).reshape(tensor.shape)

    def describe(self) -> dict[str, object]:
        """What a same-host puller needs to map it (the `x` of a host-local reply)."""
        return {"k": "fd", "pid": os.getpid(), "fd": self.fd, "tok": self.token, "n": self.nbytes}

    def hold(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("segment already closed")
            self._refs += 1

    def drop(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            os.close(self.fd)  # a puller that mapped it keeps its mapping; no new one can open it
            self.data = None  # unmapped here once no tensor over it is left either

    @property
    def closed(self) -> bool:
        return self._refs <= 0


def read_into(desc: dict, dest: torch.Tensor, on_mapped: Callable[[], None] | None = None) -> None:
    """Copy a segment another process described (`Segment.describe`) into `dest` (flat uint8, CPU or
    CUDA). Raises OSError when it cannot be opened from here (another pid namespace, no permission,
    the owner gone). The mapping is closed before this returns, whatever happens. `on_mapped`: for
    tests, called once it is mapped."""
    pid, fd, token, nbytes = int(desc["pid"]), int(desc["fd"]), str(desc["tok"]), int(desc["n"])
    if dest.numel() != nbytes:
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
        # Private and writable: torch wants a writable buffer; nothing is written, so nothing is copied.
        mapped = mmap.mmap(handle, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(handle)
    try:
        if on_mapped is not None:
            on_mapped()
        source = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
        dest.copy_(source)
        del source  # no view may outlive the mapping
    finally:
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
