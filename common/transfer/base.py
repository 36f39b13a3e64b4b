"""The interface both backends implement, and the parts they share: the pull result, the owner's
reply to a pull, and the small request/reply headers of the pull protocol.

Pull by handle: the owner `publish()`es a tensor and advertises (address, handle); a receiver
`pull()`s it: it sends a request, the owner replies with a header (shape, dtype or an error) and
then the bytes. The owner keeps a published tensor until `release()` or its TTL (handles.py).

A handle can also be `reserve()`d before its tensor exists and `fill()`ed later, from any thread (a
prefill instance streams KV this way: each group of layers as the forward finishes it). A pull of a
reserved handle waits at the owner until it is filled, or answers "not found" once it is released.

Host-local: a request also carries the puller's host key and the handles it can open
(same_host.py). An owner on the same host replies with a handle to the tensor's memory (`x`)
instead of the bytes; the puller copies from it, then acknowledges (`op: ack`, with `ok` false
when it could not open it, and it then asks again for the bytes), and the owner confirms. The
owner's hold on that memory (a Lease) ends with the acknowledgement, or when the puller's
connection drops (host_local.py).
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import torch

from common.protocol.tensors import dtype_name, nbytes_of
from common.transfer.config import TransferConfig
from common.transfer.errors import SinkRefused, SizeMismatch, TransferError
from common.transfer.handles import GONE, WAITING, Entry, HandleTable, Lease, as_bytes
from common.transfer.pool import BufferPool, PoolBuffer
from common.transfer.same_host import TransferPath
from common.transfer.sink import COPIERS, EMPTY, Out, Sink

__all__ = ["HandleTable", "Pulled", "TransferBackend", "TransferConfig", "TransferPath", "as_bytes"]


class Pulled:
    """A pulled tensor. When it landed in a pool buffer, `release()` (or leaving `with`) returns
    the buffer; when it landed in the caller's `out` (or a tensor of its own), release does nothing.
    `path` says how it came (inline, the byte stream, or a host-local copy). Pulled into a Sink, its
    tensor is empty and `nbytes` what the sink was written."""

    def __init__(
        self,
        tensor: torch.Tensor,
        buffer: PoolBuffer | None = None,
        path: TransferPath = TransferPath.STREAM,
        nbytes: int | None = None,
    ) -> None:
        self.tensor = tensor
        self.path = path
        self._buffer = buffer
        self.nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes

    def take(self) -> torch.Tensor:
        """The tensor, the caller's to keep: a copy when it sits in a pool buffer (which goes back)."""
        if self._buffer is None:
            return self.tensor
        tensor = self.tensor.clone()
        self.release()
        return tensor

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass
class PathStats:
    """Pulls that took one path, since the backend started."""

    pulls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class Reply:
    """The owner's answer to one pull request."""

    header: bytes
    data: torch.Tensor | None = None  # the bytes that follow the header (flat uint8, host memory)
    lease: Lease | None = None  # host-local: the reader's hold, ended by its ack or its going away


class TransferBackend(abc.ABC):
    """A server (serves this process's published tensors) and a client (pulls others') in one."""

    scheme: ClassVar[str]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.pool = BufferPool(config.max_cached_bytes)
        self.handles = HandleTable(config)
        self.stats: dict[TransferPath, PathStats] = {path: PathStats() for path in TransferPath}
        self.host_local_fallbacks = 0  # host-local replies whose memory could not be opened here
        # For tests: called on the copying thread once a host-local source is open, before the copy.
        self.on_mapped: Callable[[], None] | None = None

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where others pull from (valid after `start()`)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    def publish(
        self, tensor: torch.Tensor, handle: str | None = None, ttl: float | None = None,
        sliding: bool = False, ready: torch.cuda.Event | None = None,
    ) -> str:  # fmt: skip
        """Serve `tensor` (kept by reference, no copy if contiguous; a CUDA tensor stays on its GPU
        within `config.device_bytes`) until released or `ttl` passes; `sliding`: `ttl` from its last
        pull instead of from now. `ready`: a CUDA event recorded where the tensor's writes were
        queued, when that was another thread or stream than this one's."""
        return self.handles.put(tensor, handle, ttl, sliding, ready)

    def reserve(self) -> str:
        """A handle to advertise now and `fill` later (from any thread); pulls wait for the fill."""
        return self.handles.reserve()

    def fill(self, handle: str, tensor: torch.Tensor) -> bool:
        """Serve `tensor` under a reserved handle; False when it was released meanwhile."""
        return self.handles.fill(handle, tensor)

    def release(self, handle: str) -> bool:
        """Stop serving a handle; a transfer under way finishes, and a same-host reader's copy too
        (its memory is freed when the reader lets go). False if it was not held."""
        return self.handles.pop(handle)

    def answer(self, request: dict, wake: Callable[[], None]) -> Reply | None:
        """The owner's reply to a pull request. A puller without the deployment's secret is refused
        whatever it asks. None while the handle is reserved or being prepared for this pull:
        `wake()` is called (from another thread) when asking again will answer."""
        if self.config.secret and not hmac.compare_digest(
            str(request.get("k", "")).encode(), self.config.secret.encode()
        ):
            return Reply(pack_error("forbidden", "wrong or missing transfer secret"))
        handle = str(request.get("h", ""))
        entry = self.handles.serve(handle, wake)
        if entry is WAITING:
            return None
        if entry is None:
            return Reply(pack_error("not_found", f"handle {handle} is not held"))
        expect = int(request.get("n", -1))
        if expect >= 0 and expect != entry.nbytes:
            msg = f"handle {handle} holds {entry.nbytes} bytes; the receiver expects {expect}"
            return Reply(pack_error("size_mismatch", msg))
        prepared = self.handles.prepare(entry, request, wake)
        if prepared is WAITING:
            return None
        if prepared is GONE:
            return Reply(pack_error("not_found", f"handle {handle} was released"))
        return reply_to(entry, prepared)

    async def pull(self, address: str, handle: str, out: Out = None, timeout: float | None = None) -> Pulled:
        """Fetch a tensor by handle into `out` (a contiguous CPU or CUDA tensor; or a Sink, which
        writes its bytes where it wants: sink.py) or a pool buffer, or, copied host-local from a
        CUDA tensor, a tensor on `config.device`. Raises a TransferError subclass, promptly, on
        any failure."""
        t0 = time.perf_counter()
        pulled = await self._pull(address, handle, out, timeout or self.config.timeout)
        if isinstance(out, Sink) and pulled.path != TransferPath.HOST_LOCAL:
            pulled = await write_landed(out, pulled)  # streamed into a pool buffer
        stats = self.stats[pulled.path]
        stats.pulls += 1
        stats.bytes += pulled.nbytes
        stats.seconds += time.perf_counter() - t0
        return pulled

    @abc.abstractmethod
    async def _pull(self, address: str, handle: str, out: Out, timeout: float) -> Pulled: ...

    async def pull_many(
        self,
        address: str,
        handles: list[str],
        outs: Sequence[torch.Tensor | Sink] | None = None,
        timeout: float | None = None,
    ) -> list[Pulled]:
        """Several handles from one owner, in flight together (e.g. a request's KV layer groups)."""
        outs_or_none = list(outs) if outs is not None else [None] * len(handles)
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


# Writes up to this size run on the caller's thread (well under a millisecond): a copier thread's
# hand-off would cost more than the copy.
SMALL_WRITE = 256 << 10


def write_inline(sink: Sink, tensor: torch.Tensor) -> None:
    """A small tensor (one that came inside its message, or a small pull) written into `sink` on
    this thread."""
    check_nbytes(sink.nbytes, tensor.numel() * tensor.element_size())
    try:
        sink.write(as_bytes(tensor.contiguous()))
    except Exception as exc:
        raise SinkRefused(f"the bytes could not be written where they go: {exc}") from exc


async def write_landed(sink: Sink, pulled: Pulled) -> Pulled:
    """A pull that landed in a pool buffer (streamed), written into `sink` — off the event loop
    unless it is small — and the buffer back once the write is over."""
    if sink.nbytes <= SMALL_WRITE:
        try:
            write_inline(sink, pulled.tensor)
        finally:
            pulled.release()
        return Pulled(EMPTY, path=pulled.path, nbytes=sink.nbytes)
    job = COPIERS.submit(sink.write, as_bytes(pulled.tensor))
    try:
        await asyncio.shield(asyncio.wrap_future(job))
    except asyncio.CancelledError:
        job.add_done_callback(lambda _: pulled.release())
        raise
    except Exception as exc:
        pulled.release()
        raise SinkRefused(f"the pulled bytes could not be written where they go: {exc}") from exc
    pulled.release()
    return Pulled(EMPTY, path=pulled.path, nbytes=sink.nbytes)


def reply_to(entry: Entry, prepared: Lease | None) -> Reply:
    """The ok reply for a prepared entry: a handle to its memory (with the lease), or its bytes."""
    header: dict[str, object] = {
        "ok": True, "s": list(entry.tensor.shape), "d": dtype_name(entry.tensor.dtype), "n": entry.nbytes,
    }  # fmt: skip
    if prepared is not None:
        return Reply(msgpack.packb({**header, "x": prepared.descriptor}, use_bin_type=True), lease=prepared)
    return Reply(msgpack.packb(header), data=entry.host_bytes)


# -- the pull protocol's headers (msgpack maps, tiny) --------------------------------------------------
def pack_request(handle: str, expect_nbytes: int = -1, **extra: object) -> bytes:
    return msgpack.packb({"op": "pull", "h": handle, "n": expect_nbytes, **extra}, use_bin_type=True)


def pack_error(code: str, message: str) -> bytes:
    return msgpack.packb({"ok": False, "e": code, "m": message})


def pack_ack(ok: bool, message: str = "", **extra: object) -> bytes:
    """A host-local reader's word to the owner: copied (`ok`), or could not open the handle."""
    return msgpack.packb({"op": "ack", "ok": ok, "m": message, **extra}, use_bin_type=True)


CONFIRM = msgpack.packb({"ok": True})  # the owner's answer to an ack: its hold has ended


def unpack(data: bytes | bytearray | memoryview) -> dict:
    try:
        value = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise TransferError(f"unreadable transfer header: {exc}") from None
    if not isinstance(value, dict):
        raise TransferError("transfer header is not a map")
    return value


@dataclass
class Landing:
    """Where one pulled tensor's bytes go: they are written into `data` (flat uint8), then
    `finish()` makes the Pulled. A stream into a CUDA `out` lands in a pool buffer first. A
    host-local copy into a Sink has no `data`: the copy hands the owner's bytes to `sink`."""

    tensor: torch.Tensor  # what the pull returns
    data: torch.Tensor
    buffer: PoolBuffer | None = None  # the pool's, lent while `data` is in it
    staged: bool = field(default=False)  # `data` is a host copy to move into `tensor` at the end
    sink: Sink | None = None

    def finish(self, path: TransferPath) -> Pulled:
        if self.staged:
            as_bytes(self.tensor).copy_(self.data)
            self.abandon()
        if self.sink is not None and path == TransferPath.HOST_LOCAL:
            return Pulled(self.tensor, path=path, nbytes=self.sink.nbytes)
        return Pulled(self.tensor, self.buffer, path)

    def abandon(self) -> None:
        """Give the pool buffer back (after a failure: nothing may write into it any more)."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


def destination(
    pool: BufferPool, shape: tuple[int, ...], dtype: str, out: Out, host: bool = True,
    device: str | None = None,
) -> Landing:  # fmt: skip
    """Where the bytes of a (shape, dtype) tensor land: `out`, or a pool buffer; `host=False` (a
    host-local copy) writes straight into a CUDA `out`, and without `out` onto `device` if given.
    For a Sink: a host-local copy hands it the owner's bytes, streamed ones land in a pool buffer
    first (`pull` writes them into the sink)."""
    nbytes = nbytes_of(shape, dtype)
    if isinstance(out, Sink):
        check_nbytes(out.nbytes, nbytes)
        if not host:
            return Landing(EMPTY, EMPTY, sink=out)
        out = None
    if out is not None:
        check_out(out, nbytes)
        if out.device.type == "cpu" or not host:
            return Landing(out, as_bytes(out))
        buf = pool.acquire(nbytes)
        return Landing(out, buf.data, buf, staged=True)
    if device is not None and not host:
        from common.protocol.tensors import torch_dtype

        tensor = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        return Landing(tensor, as_bytes(tensor))
    buf = pool.acquire(nbytes)
    return Landing(buf.view(shape, dtype), buf.data, buf)


def check_out(out: torch.Tensor, nbytes: int) -> None:
    if out.device.type not in ("cpu", "cuda") or not out.is_contiguous():
        raise SizeMismatch("the destination must be a contiguous CPU or CUDA tensor")
    check_nbytes(out.numel() * out.element_size(), nbytes)


def check_nbytes(have: int, nbytes: int) -> None:
    """A destination (tensor or Sink) holds exactly the tensor's bytes; SizeMismatch if not."""
    if have != nbytes:
        raise SizeMismatch(f"the destination holds {have} bytes; the tensor has {nbytes}")


def out_nbytes(out: Out) -> int:
    if isinstance(out, Sink):
        return out.nbytes
    return -1 if out is None else out.numel() * out.element_size()
