"""One TCP transfer connection, plain or TLS, behind the same three calls.

Plain: tensor memory moves straight between the socket and the tensor (`sock_sendall` /
`sock_recv_into` on memoryviews), with no intermediate copy. TLS: asyncio's TLS transport
encrypts and decrypts; received bytes are copied once from its buffer into the tensor.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

_SOCK_BUF = 4 * 1024 * 1024
_TLS_READ = 1 << 20  # the most one TLS read hands over
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


class TlsChannel(Channel):
    """A connection over TLS (both ends showing the deployment's certificates)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def send(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self._writer.write(part)
        await self._writer.drain()  # past it the transport has encrypted what it was handed

    async def recv_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            chunk = await self._reader.read(min(len(view) - got, _TLS_READ))
            if not chunk:
                break
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        return got

    def close(self) -> None:
        self._writer.close()


async def connected(sock: socket.socket, tls: ssl.SSLContext | None) -> Channel:
    """A channel over a socket just connected; with `tls`, after the handshake (OSError if it fails)."""
    if tls is None:
        return Channel(sock)
    reader, writer = await asyncio.open_connection(
        sock=sock, ssl=tls, server_hostname="", ssl_handshake_timeout=HANDSHAKE_TIMEOUT
    )
    return TlsChannel(reader, writer)


async def accepted(sock: socket.socket, tls: ssl.SSLContext | None) -> Channel:
    """A channel over a socket just accepted; with `tls`, after the client proved its certificate."""
    if tls is None:
        return Channel(sock)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_TLS_READ, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, sock=sock, ssl=tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT
    )
    return TlsChannel(reader, asyncio.StreamWriter(transport, protocol, reader, loop))
