"""The interface both backends implement, and the parts they share: the owner's handle table, the
pull result, and the small request/reply headers of the pull protocol.

Pull by handle: the owner `publish()`es a tensor and advertises (address, handle); a receiver
`pull()`s it: it sends a request, the owner replies with a header (shape, dtype or an error) and
then the bytes. The owner keeps a published tensor until `release()` or its TTL.

A handle can also be `reserve()`d before its tensor exists and `fill()`ed later, from any thread (a
prefill instance streams KV this way: each group of layers as the forward finishes it). A pull of a
reserved handle waits at the owner until it is filled, or answers "not found" once it is released.
"""

from __future__ import annotations

import abc
import asyncio
import heapq
import hmac
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import msgpack
import torch

from common.protocol.tensors import dtype_name, nbytes_of
from common.tls import Tls
from common.transfer.errors import SizeMismatch, TransferError
from common.transfer.pool import BufferPool, PoolBuffer


@dataclass(frozen=True)
class TransferConfig:
    """Transfer settings; `backend="auto"` takes UCX when ucxx imports, else TCP."""

    backend: Literal["auto", "ucx", "tcp"] = "auto"
    host: str = "127.0.0.1"  # where the TCP server binds; "0.0.0.0" for other hosts
    advertise_host: str | None = None  # the host others dial, when it differs from `host`
    port: int = 0
    timeout: float = 10.0  # default deadline of one pull
    max_cached_bytes: int = 1 << 30  # idle pool buffers kept for reuse
    # UCX transports. Not cma: with UCX error handling off (needed for shared memory at all) a
    # peer that dies during a cma read aborts the reader's process. See docs/substrate.md.
    ucx_tls: str = "^cma"
    # While a UCX pull waits, ping the owner this often; a dead owner fails the ping at once.
    probe_interval: float = 0.25
    inline_max_bytes: int = 256 * 1024  # smaller tensors ride inside the NATS message
    # Sent with every pull, and asked of every puller: a client without it gets nothing. Empty: open.
    secret: str = ""
    # The deployment's certificates: TCP transfers go over mutual TLS (UCX has no encryption, so
    # "auto" then picks TCP, and "ucx" is refused).
    tls: Tls | None = None


@dataclass
class _Entry:
    tensor: torch.Tensor | None  # contiguous, CPU; None while reserved, not yet filled
    bytes_view: torch.Tensor | None  # the same memory as uint8 [nbytes]
    expires: float | None
    sliding: float | None = None  # each serve extends `expires` to now + this (a hot tensor stays)
    waiters: list[Callable[[], None]] | None = None  # pulls of a reserved entry, woken when it is filled
    used: float = 0.0  # monotonic time it was published or last served

    @property
    def ready(self) -> bool:
        return self.tensor is not None


WAITING = _Entry(None, None, None)  # `HandleTable.serve`: the entry is reserved; the pull is woken later


class HandleTable:
    """What an owner serves: handle -> tensor, shared by the event loop and a transport thread."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._expiry: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def put(self, tensor: torch.Tensor, handle: str | None, ttl: float | None, sliding: bool = False) -> str:
        tensor = _servable(tensor)
        handle = handle or uuid.uuid4().hex
        now = time.monotonic()
        expires = now + ttl if ttl else None
        entry = _Entry(tensor, as_bytes(tensor), expires, ttl if sliding and ttl else None, used=now)
        with self._lock:
            self._entries[handle] = entry
            if expires is not None:
                heapq.heappush(self._expiry, (expires, handle))
        return handle

    def reserve(self) -> str:
        """A handle whose tensor comes later (`fill`); held, with no TTL, until filled and released."""
        handle = uuid.uuid4().hex
        with self._lock:
            self._entries[handle] = _Entry(None, None, None, waiters=[])
        return handle

    def fill(self, handle: str, tensor: torch.Tensor) -> bool:
        """Give a reserved handle its tensor and wake the pulls waiting for it. False (and nothing
        kept) when the handle was released meanwhile, or is not a reserved one."""
        tensor = _servable(tensor)
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or entry.ready:
                return False
            entry.tensor, entry.bytes_view = tensor, as_bytes(tensor)
            waiters, entry.waiters = entry.waiters or [], None
        for wake in waiters:
            wake()
        return True

    def get(self, handle: str) -> _Entry | None:
        with self._lock:
            self._expire_locked()
            return self._entries.get(handle)

    def serve(self, handle: str, wake: Callable[[], None] | None = None) -> _Entry | None:
        """The entry a pull asked for; a sliding one lives `ttl` on from now. A reserved one, with
        `wake`: WAITING, and `wake()` is called (from the filling or releasing thread) once it is
        filled or released, to serve the pull then; without `wake`: None, as if not held."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(handle)
            if entry is not None and not entry.ready:
                if wake is None:
                    return None
                entry.waiters.append(wake)
                return WAITING
            if entry is not None:
                entry.used = time.monotonic()
            if entry is not None and entry.sliding is not None:
                entry.expires = entry.used + entry.sliding
                heapq.heappush(self._expiry, (entry.expires, handle))
            return entry

    def __contains__(self, handle: str) -> bool:
        return self.get(handle) is not None

    def last_use(self, handle: str) -> float | None:
        """When the handle was published or last served (monotonic); None if it is not held."""
        entry = self.get(handle)
        return entry.used if entry is not None else None

    def pop(self, handle: str) -> bool:
        with self._lock:
            entry = self._entries.pop(handle, None)
        for wake in (entry.waiters or []) if entry is not None else []:
            wake()  # a pull waiting for it is answered "not found"
        return entry is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire_locked()
            return len(self._entries)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, handle = heapq.heappop(self._expiry)
            entry = self._entries.get(handle)
            if entry is not None and entry.expires is not None and entry.expires <= now:
                del self._entries[handle]


class Pulled:
    """A pulled tensor. When it landed in a pool buffer, `release()` (or leaving `with`) returns
    the buffer; when it landed in the caller's `out`, release does nothing."""

    def __init__(self, tensor: torch.Tensor, buffer: PoolBuffer | None = None) -> None:
        self.tensor = tensor
        self._buffer = buffer

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class TransferBackend(abc.ABC):
    """A server (serves this process's published tensors) and a client (pulls others') in one."""

    scheme: ClassVar[str]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.pool = BufferPool(config.max_cached_bytes)
        self.handles = HandleTable()

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where others pull from (valid after `start()`)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def publish(
        self, tensor: torch.Tensor, handle: str | None = None, ttl: float | None = None, sliding: bool = False
    ) -> str:
        """Serve `tensor` (kept by reference, no copy if contiguous CPU) until released or `ttl` passes;
        `sliding`: `ttl` from its last pull instead of from now."""
        return self.handles.put(tensor, handle, ttl, sliding)

    def reserve(self) -> str:
        """A handle to advertise now and `fill` later (from any thread); pulls wait for the fill."""
        return self.handles.reserve()

    def fill(self, handle: str, tensor: torch.Tensor) -> bool:
        """Serve `tensor` under a reserved handle; False when it was released meanwhile."""
        return self.handles.fill(handle, tensor)

    def release(self, handle: str) -> bool:
        """Stop serving a handle; a transfer already under way finishes. False if it was not held."""
        return self.handles.pop(handle)

    def answer(
        self, request: dict, wake: Callable[[], None] | None = None
    ) -> tuple[bytes, _Entry | None] | None:
        """The owner's reply header to a pull request, and the entry whose bytes follow it (None:
        nothing follows). A puller without the deployment's secret is refused whatever it asks.
        A reserved handle, with `wake`: None, and `wake()` is called when asking again will answer."""
        if self.config.secret and not hmac.compare_digest(
            str(request.get("k", "")).encode(), self.config.secret.encode()
        ):
            return pack_refusal(), None
        handle = str(request.get("h", ""))
        entry = self.handles.serve(handle, wake)
        if entry is WAITING:
            return None
        header, has_data = pack_reply(entry, handle, int(request.get("n", -1)))
        return header, entry if has_data else None

    @abc.abstractmethod
    async def pull(
        self, address: str, handle: str, out: torch.Tensor | None = None, timeout: float | None = None
    ) -> Pulled:
        """Fetch a tensor by handle. Raises a TransferError subclass, promptly, on any failure."""

    async def pull_many(
        self,
        address: str,
        handles: list[str],
        outs: list[torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> list[Pulled]:
        """Several handles from one owner, in flight together (e.g. a request's KV layer groups)."""
        outs_or_none: list[torch.Tensor | None] = list(outs) if outs is not None else [None] * len(handles)
        results = await asyncio.gather(
            *(self.pull(address, h, o, timeout) for h, o in zip(handles, outs_or_none, strict=True)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for r in results:
                if isinstance(r, Pulled):
                    r.release()
            raise failures[0]
        return results  # type: ignore[return-value]


# -- the pull protocol's headers (msgpack maps, tiny) --------------------------------------------------
def pack_request(handle: str, expect_nbytes: int = -1, **extra: object) -> bytes:
    return msgpack.packb({"op": "pull", "h": handle, "n": expect_nbytes, **extra}, use_bin_type=True)


def pack_refusal() -> bytes:
    return msgpack.packb({"ok": False, "e": "forbidden", "m": "wrong or missing transfer secret"})


def pack_reply(entry: _Entry | None, handle: str, expect_nbytes: int) -> tuple[bytes, bool]:
    """The owner's reply header, and whether data follows it."""
    if entry is None:
        return msgpack.packb({"ok": False, "e": "not_found", "m": f"handle {handle} is not held"}), False
    nbytes = entry.bytes_view.numel()
    if expect_nbytes >= 0 and expect_nbytes != nbytes:
        msg = f"handle {handle} holds {nbytes} bytes; the receiver expects {expect_nbytes}"
        return msgpack.packb({"ok": False, "e": "size_mismatch", "m": msg}), False
    header = {"ok": True, "s": list(entry.tensor.shape), "d": dtype_name(entry.tensor.dtype), "n": nbytes}
    return msgpack.packb(header), True


def unpack(data: bytes | bytearray | memoryview) -> dict:
    try:
        value = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise TransferError(f"unreadable transfer header: {exc}") from None
    if not isinstance(value, dict):
        raise TransferError("transfer header is not a map")
    return value


def destination(
    pool: BufferPool, shape: tuple[int, ...], dtype: str, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, PoolBuffer | None]:
    """Where the bytes of a (shape, dtype) tensor land: `out` or a pool buffer.

    Returns the typed tensor, its uint8 byte view, and the pool buffer (None for `out`).
    """
    nbytes = nbytes_of(shape, dtype)
    if out is not None:
        check_out(out, nbytes)
        return out, as_bytes(out), None
    buf = pool.acquire(nbytes)
    return buf.view(shape, dtype), buf.data, buf


def check_out(out: torch.Tensor, nbytes: int) -> None:
    if out.device.type != "cpu" or not out.is_contiguous():
        raise SizeMismatch("the destination must be a contiguous CPU tensor")
    have = out.numel() * out.element_size()
    if have != nbytes:
        raise SizeMismatch(f"the destination holds {have} bytes; the tensor has {nbytes}")


def _servable(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")  # CPU-only transports; a CUDA-aware UCX could send device memory
    tensor = tensor.detach().contiguous()
    dtype_name(tensor.dtype)  # refuse dtypes that cannot travel, at publish time
    return tensor


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (bfloat16 included, which numpy lacks)."""
    return tensor.reshape(-1).view(torch.uint8)


def out_nbytes(out: torch.Tensor | None) -> int:
    return -1 if out is None else out.numel() * out.element_size()
