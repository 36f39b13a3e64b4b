"""CUDA tensors read by another process of the same host through CUDA IPC, with torch's own calls.

Owner: `CudaExport(tensor)` takes the IPC handle of the caching allocator's block that holds the
tensor (`UntypedStorage._share_cuda_`: the handle of the whole cudaMalloc segment, the storage's
offset in it) once, and `describe()` says where the tensor lies in it. Reader: `copy_from` opens
the handle on its own GPU (`_new_shared_cuda`: cudaIpcOpenMemHandle through the allocator's cache
of opened handles, with peer access where the GPUs differ), copies the bytes into its destination
(a buffer, or a decoder's KV blocks through a Sink) on a side stream, waits for the copy, and
closes the mapping before it returns.

Lifetimes. torch counts a shared storage's readers in a shared-memory file: sharing sets its
counter to 1, a reader decrements it when it drops the storage, and the owner frees the memory only
at 0 (else it parks the block until the counter gets there, for ever if a reader died holding it).
Here that count is set back to 0 at once, and readers are handed a counter name that does not
exist (torch's reader-side decrement is best effort and skips a missing file), so torch never
parks the block: what keeps the memory from being reused while a reader may copy it is the owner
holding the tensor itself, as long as the export's holders (its entry, each open lease) last. A
lease ends on the reader's acknowledgement, sent after its copy finished, or when it is gone.
torch's counter file (/dev/shm/torch_<pid>_..., one per 10,000 shares) is torch's: it is removed
when the owner exits, except after a SIGKILL.

Stream order: the owner answers only once the event recorded after the tensor was written has
completed (handles.py), so the reader needs no IPC event and waits on nothing of the owner's.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.transfer.errors import TransferError

# A shared-memory name nobody creates: a reader's storage, when dropped, tries to decrement torch's
# counter there, fails quietly, and leaves the owner's count alone.
NO_COUNTER = f"/trident-no-counter-{uuid.uuid4().hex}".encode()


@dataclass(frozen=True)
class CudaHandle:
    """Where a CUDA tensor lies: the IPC handle of its allocation and the offsets inside it."""

    device: int  # the owner's device index (for logs; the reader opens on its own device)
    handle: bytes  # torch's encoding of the allocation's cudaIpcMemHandle
    storage_bytes: int  # the shared storage's size
    storage_offset: int  # the storage's start in the allocation, bytes
    offset: int  # the tensor's start in the storage, bytes
    nbytes: int  # the tensor's bytes (contiguous)
    event: bytes  # torch's IPC event handle of the share (passed on; not waited on)

    def to_wire(self) -> dict[str, object]:
        return {
            "k": "cuda", "dev": self.device, "h": self.handle, "sb": self.storage_bytes,
            "so": self.storage_offset, "o": self.offset, "n": self.nbytes, "ev": self.event,
        }  # fmt: skip

    @classmethod
    def from_wire(cls, desc: dict) -> CudaHandle:
        try:
            handle = cls(
                int(desc["dev"]), bytes(desc["h"]), int(desc["sb"]), int(desc["so"]), int(desc["o"]),
                int(desc["n"]), bytes(desc["ev"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"unreadable CUDA IPC handle: {exc!r}") from None
        sizes = (handle.storage_bytes, handle.storage_offset, handle.offset, handle.nbytes)
        if not handle.handle or min(sizes) < 0:
            raise TransferError("CUDA IPC handle with no handle or a negative size")
        if handle.offset + handle.nbytes > handle.storage_bytes:
            raise TransferError("CUDA IPC handle: the tensor overruns its storage")
        return handle

    def open_args(self, device_index: int) -> tuple:
        """`UntypedStorage._new_shared_cuda`'s arguments, to open it on `device_index`: torch's
        counter replaced by NO_COUNTER, and no event to wait on."""
        where = (self.handle, self.storage_bytes, self.storage_offset)
        return (device_index, *where, NO_COUNTER, 0, self.event, False)


class CudaExport:
    """The owner's side: a CUDA tensor shared once, counted like shm.Segment (hold/drop)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        device, handle, size, offset, counter, counter_offset, event, _ = storage._share_cuda_()
        self.handle = CudaHandle(
            device=int(device), handle=bytes(handle), storage_bytes=int(size), storage_offset=int(offset),
            offset=tensor.storage_offset() * tensor.element_size(),
            nbytes=tensor.numel() * tensor.element_size(), event=bytes(event),
        )  # fmt: skip
        # Readers are not counted by torch (see above): its count is back to 0 from now on.
        torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
        self._tensor: torch.Tensor | None = tensor  # its memory stays ours while anyone holds this
        self._refs = 1
        self._lock = threading.Lock()

    def describe(self) -> dict[str, object]:
        return self.handle.to_wire()

    def hold(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("CUDA export already released")
            self._refs += 1

    def drop(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._tensor = None  # freed (back to the caching allocator) with its last reference

    @property
    def closed(self) -> bool:
        return self._refs <= 0


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for IPC copies, off the engine's stream."""
    with _streams_lock:
        stream = _streams.get(device.index)
        if stream is None:
            stream = _streams[device.index] = torch.cuda.Stream(device)
        return stream


def bytes_of_storage(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of `nbytes` of a storage from byte `offset` (any device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (nbytes,), (1,))


def copy_from(
    handle: CudaHandle,
    dest: torch.Tensor | Callable[[torch.Tensor], None],
    device: torch.device,
    on_mapped: Callable[[], None] | None = None,
) -> None:
    """Open `handle` on `device` (a CUDA device of this process), copy its bytes into `dest` (flat
    uint8, any device) or hand them (flat uint8, on the owner's memory) to `dest(source)`, which
    queues its copies on the current stream (a Sink's write: straight into KV blocks); wait for the
    copy, and close the mapping. Raises (RuntimeError) where the handle cannot be opened here:
    another IPC namespace, a GPU without peer access, the owner gone."""
    if isinstance(dest, torch.Tensor) and dest.numel() != handle.nbytes:
        raise TransferError(f"CUDA handle holds {handle.nbytes} bytes; the destination {dest.numel()}")
    if handle.nbytes == 0:
        return
    stream = _copy_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        storage = torch.UntypedStorage._new_shared_cuda(*handle.open_args(device.index))
        try:
            if on_mapped is not None:
                on_mapped()
            source = bytes_of_storage(storage, handle.offset, handle.nbytes)
            if isinstance(dest, torch.Tensor):
                dest.copy_(source, non_blocking=True)
            else:
                dest(source)
            stream.synchronize()
            del source
        finally:
            # Dropped on this stream (its deleter synchronises the current stream, then closes the
            # handle once no storage of this process uses it).
            del storage
