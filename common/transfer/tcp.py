"""TCP transfer: the fallback where ucxx is missing, and the backend whenever the deployment
speaks TLS, with the same interface and errors.

Frames: a request is `u32 length + msgpack`; a reply is `u32 length + msgpack header`, then the
raw bytes when the header says ok. Plain connections move tensor memory with no intermediate copy;
TLS ones decrypt straight into the tensor (tcp_channel.py). Connections are persistent: a client
keeps idle ones per owner and reuses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections import defaultdict

from common.transfer import host_local, same_host
from common.transfer.base import (
    CONFIRM,
    Pulled,
    Reply,
    TransferBackend,
    TransferConfig,
    destination,
    out_nbytes,
    pack_ack,
    pack_request,
    unpack,
)
from common.transfer.errors import (
    PeerLost,
    PeerUnreachable,
    TransferClosed,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from common.transfer.same_host import TransferPath
from common.transfer.sink import Out
from common.transfer.tcp_channel import Channel, accepted, connected, tune

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_HEADER = 64 * 1024
_MAX_IDLE_PER_PEER = 8


def parse_tcp_address(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise PeerUnreachable(f"not a TCP transfer address: {address!r}")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise PeerUnreachable(f"bad TCP transfer address: {address!r}")
    return host.strip("[]"), int(port)


class TcpClient:
    """Pulls over TCP; also used by the UCX backend for owners that only speak TCP."""

    def __init__(self, backend: TransferBackend) -> None:
        self._backend = backend
        self._idle: dict[tuple[str, int], list[Channel]] = defaultdict(list)
        self._closed = False
        tls = backend.config.tls
        self._tls: ssl.SSLContext | None = tls.client_context() if tls is not None else None

    async def pull(self, address: str, handle: str, out: Out, timeout: float) -> Pulled:
        peer = parse_tcp_address(address)
        try:
            async with asyncio.timeout(timeout):
                return await self._pull(peer, handle, out)
        except TimeoutError:
            raise TransferTimeout(f"pull of {handle} from {address} took over {timeout}s") from None

    async def _pull(self, peer: tuple[str, int], handle: str, out: Out) -> Pulled:
        if self._closed:
            raise TransferClosed("transfer backend closed")
        config = self._backend.config
        stream_only = pack_request(handle, out_nbytes(out), k=config.secret)
        offer = same_host.offer(config)
        request = pack_request(handle, out_nbytes(out), k=config.secret, **offer) if offer else stream_only
        chan, header = await self._ask(peer, request)
        if header.get("ok") and "x" in header:
            pulled = await self._host_local(chan, header, out)
            if pulled is not None:
                self._checkin(peer, chan)
                return pulled
            header = await self._ask_again(chan, stream_only)  # it could not be opened here
        try:
            pulled = await self._read_body(chan, header, out)
        except BaseException:
            chan.close()  # a half-read reply leaves the stream unusable
            raise
        self._checkin(peer, chan)
        return pulled

    async def _ask(self, peer: tuple[str, int], request: bytes) -> tuple[Channel, dict]:
        """Send a request and read the reply's header."""
        # A reused connection may have died idle (owner restarted): retry once on a fresh one,
        # which is safe because nothing of the reply has arrived yet.
        for attempt in range(2):
            chan, reused = await self._checkout(peer)
            try:
                await chan.send(_LEN.pack(len(request)) + request)
                return chan, await self._read_header(chan)
            except (OSError, PeerLost) as exc:
                chan.close()
                if reused and attempt == 0:
                    continue
                raise PeerLost(f"connection to {peer[0]}:{peer[1]} lost: {exc}") from None
            except BaseException:
                chan.close()
                raise
        raise AssertionError("unreachable")

    async def _ask_again(self, chan: Channel, request: bytes) -> dict:
        """Another request on a connection in use (no retry: the owner was there a moment ago)."""
        try:
            await chan.send(_LEN.pack(len(request)) + request)
            return await self._read_header(chan)
        except (OSError, PeerLost) as exc:
            chan.close()
            raise PeerLost(f"connection to the owner lost: {exc}") from None
        except BaseException:
            chan.close()
            raise

    async def _host_local(self, chan: Channel, header: dict, out: Out) -> Pulled | None:
        """Copy from the owner's memory, acknowledge, and wait for its confirmation (proof that it
        held the memory throughout). None: the handle could not be opened here, which the
        acknowledgement said; the caller asks for the bytes on the same connection."""
        try:
            spot = host_local.landing(self._backend, header, out)
        except BaseException:
            chan.close()  # the owner's hold ends with the connection
            raise
        loop = asyncio.get_running_loop()
        job = host_local.start(self._backend, header, spot)
        failed = await host_local.copied(job, spot, lambda: loop.call_soon_threadsafe(chan.close))
        try:
            ack = pack_ack(failed is None, failed or "")
            await chan.send(_LEN.pack(len(ack)) + ack)
            confirm = await self._read_header(chan)
        except (OSError, PeerLost) as exc:
            spot.abandon()
            chan.close()
            raise PeerLost(f"owner went away during a host-local copy: {exc}") from None
        except BaseException:
            spot.abandon()
            chan.close()
            raise
        if failed is not None or not confirm.get("ok"):
            spot.abandon()
            self._backend.host_local_fallbacks += 1
            log.debug("host-local copy failed (%s); pulling the bytes", failed)
            if not confirm.get("ok"):
                chan.close()
                raise TransferError(f"owner did not confirm a host-local copy: {confirm}")
            return None
        return spot.finish(TransferPath.HOST_LOCAL)

    async def _read_header(self, chan: Channel) -> dict:
        raw_len = bytearray(4)
        if await chan.recv_into(memoryview(raw_len)) < 4:
            raise PeerLost("owner closed the connection")
        (length,) = _LEN.unpack(raw_len)
        if length > _MAX_HEADER:
            raise TransferError(f"reply header of {length} bytes is not a header")
        raw = bytearray(length)
        if await chan.recv_into(memoryview(raw)) < length:
            raise PeerLost("owner closed the connection mid-header")
        return unpack(raw)

    async def _read_body(self, chan: Channel, header: dict, out: Out) -> Pulled:
        if not header.get("ok"):
            raise error_from_code(str(header.get("e")), str(header.get("m", "")))
        spot = destination(self._backend.pool, tuple(header["s"]), header["d"], out)
        try:
            view = memoryview(spot.data.numpy()) if spot.data.numel() else memoryview(b"")
            try:
                got = await chan.recv_into(view)
            except OSError as exc:
                raise PeerLost(f"connection lost mid-transfer: {exc}") from None
            if got < len(view):
                raise PeerLost(f"owner went away after {got} of {len(view)} bytes")
        except BaseException:
            spot.abandon()
            raise
        return spot.finish(TransferPath.STREAM)

    async def _checkout(self, peer: tuple[str, int]) -> tuple[Channel, bool]:
        idle = self._idle.get(peer)
        if idle:
            return idle.pop(), True
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(peer[0], peer[1], type=socket.SOCK_STREAM)
            sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        except OSError as exc:
            raise PeerUnreachable(f"cannot resolve {peer[0]}:{peer[1]}: {exc}") from None
        try:
            tune(sock)
            await loop.sock_connect(sock, infos[0][4])
            return await connected(sock, self._tls), False
        except OSError as exc:  # ssl.SSLError is one: a handshake the owner refused
            sock.close()
            raise PeerUnreachable(f"cannot connect to {peer[0]}:{peer[1]}: {exc}") from None

    def _checkin(self, peer: tuple[str, int], chan: Channel) -> None:
        idle = self._idle[peer]
        if self._closed or len(idle) >= _MAX_IDLE_PER_PEER:
            chan.close()
        else:
            idle.append(chan)

    def close(self) -> None:
        self._closed = True
        for chans in self._idle.values():
            for chan in chans:
                chan.close()
        self._idle.clear()


class TcpBackend(TransferBackend):
    """Serves published tensors on a TCP port and pulls from others over TCP."""

    scheme = "tcp"

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__(config or TransferConfig(backend="tcp"))
        self._client = TcpClient(self)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self._port = 0
        tls = self.config.tls
        self._tls: ssl.SSLContext | None = tls.server_context() if tls is not None else None

    @property
    def address(self) -> str:
        host = self.config.advertise_host or self.config.host
        return f"tcp://{host}:{self._port}"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._port = sock.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept_loop(), name="tcp-transfer-accept")

    async def close(self) -> None:
        self._client.close()
        self.handles.clear()
        tasks = [t for t in (self._accept_task, *self._conn_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _pull(self, address: str, handle: str, out: Out, timeout: float) -> Pulled:
        return await self._client.pull(address, handle, out, timeout)

    # -- server ----------------------------------------------------------------------------------------
    async def _answer_when_ready(self, request: dict) -> Reply:
        """`answer`, waiting while the handle is reserved and not yet filled, or being prepared. The
        puller's deadline bounds the wait: a puller that gave up closes the connection, and the
        reply then fails."""
        loop = asyncio.get_running_loop()
        while True:
            woken = loop.create_future()
            reply = self.answer(request, lambda w=woken: loop.call_soon_threadsafe(_wake, w))
            if reply is not None:
                return reply
            await woken

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            tune(conn)
            task = asyncio.create_task(self._serve(conn), name="tcp-transfer-conn")
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_done)

    def _conn_done(self, task: asyncio.Task[None]) -> None:
        self._conn_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("transfer connection failed: %r", task.exception())

    async def _serve(self, conn: socket.socket) -> None:
        """Answer pull requests on one connection until the client hangs up."""
        try:
            chan = await accepted(conn, self._tls)
        except OSError as exc:  # a client without the deployment's certificate, among others
            conn.close()
            log.debug("transfer handshake refused: %r", exc)
            return
        try:
            while True:
                try:
                    request = await _read_frame(chan)
                    if request is None or not await self._reply(chan, request):
                        return
                except (OSError, TransferError) as exc:
                    log.debug("transfer client went away: %r", exc)
                    return
        finally:
            chan.close()

    async def _reply(self, chan: Channel, request: dict) -> bool:
        """Answer one request (what the reply holds, a served tensor or a lease, is let go on
        return). A host-local reply lends the memory until the reader acknowledges or goes away
        (its connection drops: it died, or gave up); the owner then confirms. False: it went away."""
        reply = await self._answer_when_ready(request)
        parts = [_LEN.pack(len(reply.header)) + reply.header]
        if reply.data is not None and reply.data.numel():
            parts.append(memoryview(reply.data.numpy()))
        if reply.lease is None:
            await chan.send(*parts)
            return True
        try:
            await chan.send(*parts)
            ack = await _read_frame(chan)
            if ack is None or ack.get("op") != "ack":
                return False
        finally:
            reply.lease.end()
        if not ack.get("ok"):
            log.debug("a same-host puller could not open a handle: %s", ack.get("m"))
        await chan.send(_LEN.pack(len(CONFIRM)) + CONFIRM)
        return True


async def _read_frame(chan: Channel) -> dict | None:
    """One `u32 length + msgpack` frame; None at the end of the connection or on garbage."""
    raw_len = bytearray(4)
    if await chan.recv_into(memoryview(raw_len)) < 4:
        return None
    (length,) = _LEN.unpack(raw_len)
    if length > _MAX_HEADER:
        return None  # not our protocol; drop the connection
    raw = bytearray(length)
    if await chan.recv_into(memoryview(raw)) < length:
        return None
    return unpack(raw)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
