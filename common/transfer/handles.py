"""What an owner serves: handle → tensor, shared by the event loop, a transport thread and the
threads that publish (an engine's, streaming KV).

A CUDA tensor stays on its GPU (up to `TransferConfig.device_bytes`; past it the oldest go to host
memory), with an event recorded on the publishing thread's stream after it was written. An entry is
prepared for the pull that asks, off the serving thread (`prepare`): a same-host puller with a GPU
gets a CUDA IPC export (made once, after the event has completed), one without gets the tensor in
host memory, and for a same-host puller of a CPU tensor it is copied into a memfd of its own
(shm.py). Meanwhile the pull waits, as a pull of a reserved handle waits for its fill. A host-local
reply comes with a `Lease`: the reader's hold on that memory, ended by its acknowledgement or by its
going away. A CUDA export is freed when its entry is released (or expires) and its last lease has
ended, never before; a memfd goes back to the pool when its lease ends.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.protocol.tensors import dtype_name
from common.transfer import same_host
from common.transfer.config import TransferConfig
from common.transfer.same_host import Kind
from common.transfer.shm import Segment, SegmentPool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Entry:
    tensor: torch.Tensor | None  # contiguous; CPU, or CUDA while kept on its GPU; None while reserved
    expires: float | None
    sliding: float | None = None  # each serve extends `expires` to now + this (a hot tensor stays)
    # Pulls waiting for its fill, or for the job preparing it, woken when that ends.
    waiters: list[Callable[[], None]] = field(default_factory=list)
    ready: torch.cuda.Event | None = None  # CUDA: completes once the tensor is written
    shared: object | None = None  # its CudaExport, once a same-host puller asked; one reference ours
    segment: Segment | None = None  # a copy made for the next same-host pull (that pull's to take)
    busy: bool = False  # a job prepares it (to host memory, into a memfd, waiting for `ready`)
    no_ipc: bool = False  # its CUDA IPC export failed: served from host memory instead
    no_fd: bool = False  # copying it into a memfd failed: its bytes stream instead
    retired: bool = False  # released or expired: a job that ends on it frees what it made
    broken: bool = False  # a job preparing it failed: answered "not found" (the puller recomputes)
    used: float = 0.0  # monotonic time it was published or last served (`last_use`)

    @property
    def filled(self) -> bool:
        return self.tensor is not None

    @property
    def on_device(self) -> bool:
        return self.tensor is not None and self.tensor.device.type == "cuda"

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()

    @property
    def host_bytes(self) -> torch.Tensor:
        """Its memory as flat uint8, for a stream reply (a prepared entry is in host memory)."""
        assert self.tensor is not None and self.tensor.device.type == "cpu", "not prepared for a stream"
        return as_bytes(self.tensor)


WAITING = Entry(None, None)  # `serve`/`prepare`: the pull is woken later, and asks again
GONE = Entry(None, None)  # `prepare`: released meanwhile, and it cannot be served as it is


class Lease:
    """A same-host reader's hold on an export, from the owner's reply until `end()` (its ack, or
    its connection dropping)."""

    def __init__(self, table: HandleTable, shared, kind: Kind) -> None:
        self._table = table
        self._shared = shared
        self.kind = kind
        self.descriptor: dict[str, object] = shared.describe()
        self._ended = False

    def end(self) -> None:
        """Idempotent."""
        if self._ended:
            return
        self._ended = True
        self._shared.drop()
        with self._table._lock:
            self._table._leases -= 1


class HandleTable:
    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self._entries: dict[str, Entry] = {}
        self._expiry: list[tuple[float, str]] = []
        self._lock = threading.RLock()
        self._device: OrderedDict[int, Entry] = OrderedDict()  # entries kept on a GPU, oldest first
        self._device_bytes = 0
        self._leases = 0
        self._jobs: ThreadPoolExecutor | None = None
        self._segments = SegmentPool(self.config.max_cached_bytes)

    # -- publishing (any thread) -------------------------------------------------------------------
    def put(
        self, tensor: torch.Tensor, handle: str | None, ttl: float | None, sliding: bool = False,
        ready: torch.cuda.Event | None = None,
    ) -> str:  # fmt: skip
        tensor, ready = self._servable(tensor, ready)
        handle = handle or uuid.uuid4().hex
        now = time.monotonic()
        expires = now + ttl if ttl else None
        entry = Entry(tensor, expires, ttl if sliding and ttl else None, ready=ready, used=now)
        with self._lock:
            old = self._entries.pop(handle, None)
            if old is not None:
                self._retire_locked(old)
            self._entries[handle] = entry
            if expires is not None:
                heapq.heappush(self._expiry, (expires, handle))
            self._track_locked(entry)
        self._trim_device()
        return handle

    def reserve(self) -> str:
        """A handle whose tensor comes later (`fill`); held, with no TTL, until filled and released."""
        handle = uuid.uuid4().hex
        with self._lock:
            self._entries[handle] = Entry(None, None)
        return handle

    def fill(self, handle: str, tensor: torch.Tensor) -> bool:
        """Give a reserved handle its tensor and wake the pulls waiting for it. False (and nothing
        kept) when the handle was released meanwhile, or is not a reserved one."""
        tensor, ready = self._servable(tensor)
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or entry.filled:
                return False
            entry.tensor, entry.ready = tensor, ready
            self._track_locked(entry)
            waiters, entry.waiters = entry.waiters, []
        for wake in waiters:
            wake()
        self._trim_device()
        return True

    def _servable(
        self, tensor: torch.Tensor, ready: torch.cuda.Event | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """What is kept of a published tensor, and (CUDA) the event that completes once it is
        written: `ready` if the publisher recorded one where it queued the writes, else one recorded
        now on this thread's stream, after everything this thread queued."""
        dtype_name(tensor.dtype)  # refuse dtypes that cannot travel, at publish time
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda" and 0 < nbytes <= self.config.device_bytes:
            contiguous = tensor.contiguous()
            if ready is None or contiguous is not tensor:  # a copy made here: behind it
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tensor.device))
            return contiguous, ready
        return tensor.to("cpu").contiguous(), None

    # -- looking up (any thread) -------------------------------------------------------------------
    def get(self, handle: str) -> Entry | None:
        with self._lock:
            self._expire_locked()
            return self._entries.get(handle)

    def serve(self, handle: str, wake: Callable[[], None] | None = None) -> Entry | None:
        """The entry a pull asked for; a sliding one lives `ttl` on from now. A reserved one, or one
        a job is preparing, with `wake`: WAITING, and `wake()` is called (from another thread) once
        it is filled, prepared or released, to ask again; without `wake`: a reserved one is None."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(handle)
            if entry is None:
                return None
            if not entry.filled or (entry.busy and wake is not None):
                if wake is None:
                    return None
                entry.waiters.append(wake)
                return WAITING
            entry.used = time.monotonic()
            if entry.sliding is not None:
                entry.expires = entry.used + entry.sliding
                heapq.heappush(self._expiry, (entry.expires, handle))
            return entry

    def prepare(self, entry: Entry, request: dict, wake: Callable[[], None]) -> Lease | Entry | None:
        """Ready `entry` for the pull `request`: a Lease (a host-local reply), None (its bytes
        stream from host memory), WAITING (a job prepares it first; `wake()` when it ends), or GONE
        (released meanwhile, and not in host memory)."""
        with self._lock:
            if entry.broken or (entry.retired and entry.on_device):
                return GONE
            if entry.retired:  # released since it was looked up: what is in host memory still goes
                return None
            if entry.busy:
                entry.waiters.append(wake)
                return WAITING
            kind = same_host.choose(request, entry.tensor.device.type, entry.nbytes, self.config)
            if kind is Kind.CUDA and not entry.no_ipc:
                if entry.ready is not None and not entry.ready.query():
                    return self._start_locked(entry, _wait_ready, wake)
                if entry.shared is None and not self._export_locked(entry):
                    return self._start_locked(entry, self._to_host, wake)
                return self._lease_locked(entry, kind)
            if entry.on_device:  # a puller that cannot map it: its bytes leave from host memory
                return self._start_locked(entry, self._to_host, wake)
            if kind is Kind.FD and not entry.no_fd:
                if entry.segment is None:
                    return self._start_locked(entry, self._to_segment, wake)
                segment, entry.segment = entry.segment, None  # this pull's: it alone maps it
                return self._lend_locked(segment, kind)
            return None

    # -- releasing (any thread) --------------------------------------------------------------------
    def __contains__(self, handle: str) -> bool:
        return self.get(handle) is not None

    def last_use(self, handle: str) -> float | None:
        """When the handle was published or last served (monotonic); None if it is not held."""
        entry = self.get(handle)
        return entry.used if entry is not None else None

    def pop(self, handle: str) -> bool:
        with self._lock:
            entry = self._entries.pop(handle, None)
            if entry is None:
                return False
            waiters = self._retire_locked(entry)
        for wake in waiters:
            wake()  # a pull waiting for it is answered "not found"
        return True

    def clear(self) -> None:
        """Release everything (the backend closes)."""
        for handle in list(self._entries):
            self.pop(handle)
        self._segments.close()
        if self._jobs is not None:
            self._jobs.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._entries)

    @property
    def leases(self) -> int:
        """Same-host readers holding an export now."""
        with self._lock:
            return self._leases

    @property
    def idle_segments(self) -> int:
        """memfds kept for the next same-host pulls (each lent to one pull at a time)."""
        return self._segments.idle

    @property
    def device_bytes(self) -> int:
        """Bytes of published tensors kept on a GPU."""
        with self._lock:
            return self._device_bytes

    def _expire_locked(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, handle = heapq.heappop(self._expiry)
            entry = self._entries.get(handle)
            if entry is not None and entry.expires is not None and entry.expires <= now:
                del self._entries[handle]
                for wake in self._retire_locked(entry):
                    wake()  # only schedules the pull's next look (never re-enters here)

    def _retire_locked(self, entry: Entry) -> list[Callable[[], None]]:
        entry.retired = True
        self._untrack_locked(entry)
        for made in (entry.shared, entry.segment):
            if made is not None:
                made.drop()  # freed now, or when its last lease ends
        entry.shared = entry.segment = None
        waiters, entry.waiters = entry.waiters, []
        return waiters

    # -- preparing (under the lock; the jobs run on their own threads) ------------------------------
    def _lease_locked(self, entry: Entry, kind: Kind) -> Lease:
        entry.shared.hold()
        return self._lend_locked(entry.shared, kind)

    def _lend_locked(self, shared, kind: Kind) -> Lease:
        """A lease holding one reference to `shared` (taken by the caller)."""
        self._leases += 1
        return Lease(self, shared, kind)

    def _export_locked(self, entry: Entry) -> bool:
        from common.transfer.cuda_ipc import CudaExport

        try:
            entry.shared = CudaExport(entry.tensor)
        except Exception as exc:  # e.g. an allocator without IPC handles (cudaMallocAsync)
            log.warning("CUDA IPC export failed (%r); serving from host memory", exc)
            entry.no_ipc = True
            return False
        return True

    def _start_locked(self, entry: Entry, job: Callable[[Entry], None], wake: Callable[[], None]) -> Entry:
        entry.busy = True
        entry.waiters.append(wake)
        if self._jobs is None:
            self._jobs = ThreadPoolExecutor(max_workers=2, thread_name_prefix="transfer-prepare")
        self._jobs.submit(self._run, entry, job)
        return WAITING

    def _run(self, entry: Entry, job: Callable[[Entry], None]) -> None:
        try:
            job(entry)
        except Exception:
            log.exception("preparing a served tensor failed")
            entry.broken = True  # not tried again and again: its pulls fail, and recompute
        finally:
            with self._lock:
                entry.busy = False
                waiters, entry.waiters = entry.waiters, []
            for wake in waiters:
                wake()

    def _to_host(self, entry: Entry) -> None:
        """Move a GPU entry to host memory (its export, if any, lives on for its open leases)."""
        if not entry.on_device:
            return
        if entry.ready is not None:
            entry.ready.synchronize()
        host = entry.tensor.to("cpu")
        with self._lock:
            self._untrack_locked(entry)
            shared, entry.shared = entry.shared, None
            entry.tensor, entry.ready = host, None
        if shared is not None:
            shared.drop()

    def _to_segment(self, entry: Entry) -> None:
        try:
            segment = self._segments.copy_of(entry.tensor)
        except OSError as exc:  # out of memory or descriptors: the byte stream still works
            log.warning("copying a served tensor into shared memory failed (%r); streaming it", exc)
            entry.no_fd = True
            return
        with self._lock:
            if not entry.retired and entry.segment is None:
                entry.segment, segment = segment, None
        if segment is not None:
            segment.drop()  # released meanwhile: back to the pool

    # -- GPU memory --------------------------------------------------------------------------------
    def _track_locked(self, entry: Entry) -> None:
        if entry.on_device:
            self._device[id(entry)] = entry
            self._device_bytes += entry.nbytes

    def _untrack_locked(self, entry: Entry) -> None:
        if self._device.pop(id(entry), None) is not None:
            self._device_bytes -= entry.nbytes

    def _trim_device(self) -> None:
        """Past `device_bytes`, move the oldest idle GPU entries to host memory (on this thread)."""
        tried: set[int] = set()  # one attempt each: a failed move is not retried in a loop
        while True:
            with self._lock:
                if self._device_bytes <= self.config.device_bytes:
                    return
                victim = next((e for e in self._device.values() if not e.busy and id(e) not in tried), None)
                if victim is None:
                    return
                victim.busy = True
                tried.add(id(victim))
            self._run(victim, self._to_host)


def _wait_ready(entry: Entry) -> None:
    entry.ready.synchronize()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (bfloat16 included, which numpy lacks)."""
    return tensor.reshape(-1).view(torch.uint8)
