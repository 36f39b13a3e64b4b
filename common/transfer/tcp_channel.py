"""One TCP transfer connection, plain or TLS, behind the same three calls.

Plain: tensor memory moves straight between the socket and the tensor (`sock_sendall` /
`sock_recv_into` on memoryviews), with no intermediate copy. TLS: asyncio's TLS transport
encrypts, and decrypts received records straight into the tensor (`_TlsStream`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl

_SOCK_BUF = 4 * 1024 * 1024
_TLS_READ = 256 * 1024  # the spill buffer one TLS read may fill when no recv_into waits
_TLS_WRITE = 256 * 1024  # handed to the TLS layer at a time
HANDSHAKE_TIMEOUT = 10.0


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


class Channel:
    """A plain connection."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    async def send(self, *parts: bytes | memoryview) -> None:
        loop = asyncio.get_running_loop()
        for part in parts:
            await loop.sock_sendall(self._sock, part)

    async def recv_into(self, view: memoryview) -> int:
        """Fill `view`; returns the bytes read (short only at EOF)."""
        loop = asyncio.get_running_loop()
        got = 0
        while got < len(view):
            n = await loop.sock_recv_into(self._sock, view[got:])
            if n == 0:
                break
            got += n
        return got

    def close(self) -> None:
        self._sock.close()


class _TlsStream(asyncio.BufferedProtocol):
    """The application end of asyncio's TLS transport, reading the way `recv_into` wants.

    asyncio's TLS transport decrypts each record into the buffer its protocol hands out
    (`get_buffer`). While a `recv_into` waits, that is the caller's memory (a tensor's), so the
    bytes are decrypted straight into it; otherwise they go to a spill buffer the next read drains
    first. Writes pause while the transport's buffer is full (`drain`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._spill = bytearray()
        self._scratch = bytearray(_TLS_READ)
        self._scratch_view = memoryview(self._scratch)
        self._target: memoryview | None = None
        self._got = 0
        self._gave_target = False
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._eof = False
        self._lost: BaseException | None = None

    # -- asyncio's side --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._target
        self._gave_target = target is not None and self._got < len(target)
        # A memoryview either way: asyncio fills it in pieces through slices, and a slice of a
        # bytearray would be a copy (the bytes lost).
        return target[self._got :] if self._gave_target else self._scratch_view  # type: ignore[index]

    def buffer_updated(self, nbytes: int) -> None:
        if self._gave_target:
            self._got += nbytes
            if self._target is not None and self._got >= len(self._target):
                self._wake()
        else:
            self._spill += self._scratch[:nbytes]

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof = True
        self._lost = exc or ConnectionResetError("connection closed")
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the channel's side ----------------------------------------------------------------------
    async def recv_into(self, view: memoryview) -> int:
        n = min(len(self._spill), len(view))
        if n:
            view[:n] = self._spill[:n]
            del self._spill[:n]
        if n == len(view) or self._eof:
            return n
        self._target, self._got = view, n
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
            return self._got
        finally:
            self._target = None
            self._waiter = None

    async def send(self, parts: tuple[bytes | memoryview, ...]) -> None:
        if self._lost is not None or self.transport is None:
            raise ConnectionResetError("connection closed")
        for part in parts:
            view = memoryview(part).cast("B")
            # In pieces, each waiting for the socket to take the last: handed 64 MB at once, the
            # TLS layer encrypts it into one growing buffer and the transport copies what the
            # socket cannot take yet, a few times the bytes over.
            for start in range(0, len(view), _TLS_WRITE):
                self.transport.write(view[start : start + _TLS_WRITE])
                while self._writable is not None:
                    await self._writable
                    if self._lost is not None:
                        raise ConnectionResetError("connection closed")


class TlsChannel(Channel):
    """A connection over TLS (both ends showing the deployment's certificates)."""

    def __init__(self, stream: _TlsStream) -> None:
        self._stream = stream

    async def send(self, *parts: bytes | memoryview) -> None:
        await self._stream.send(parts)

    async def recv_into(self, view: memoryview) -> int:
        return await self._stream.recv_into(view)

    def close(self) -> None:
        if self._stream.transport is not None:
            self._stream.transport.close()


async def connected(sock: socket.socket, tls: ssl.SSLContext | None) -> Channel:
    """A channel over a socket just connected; with `tls`, after the handshake (OSError if it fails)."""
    if tls is None:
        return Channel(sock)
    stream = _TlsStream()
    await asyncio.get_running_loop().create_connection(
        lambda: stream, sock=sock, ssl=tls, server_hostname="", ssl_handshake_timeout=HANDSHAKE_TIMEOUT
    )
    return TlsChannel(stream)


async def accepted(sock: socket.socket, tls: ssl.SSLContext | None) -> Channel:
    """A channel over a socket just accepted; with `tls`, after the client proved its certificate."""
    if tls is None:
        return Channel(sock)
    stream = _TlsStream()
    await asyncio.get_running_loop().connect_accepted_socket(
        lambda: stream, sock=sock, ssl=tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT
    )
    return TlsChannel(stream)
