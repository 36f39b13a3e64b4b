"""The door's middleware and HTTP server limits under uvicorn on loopback, over real sockets, with
a small app behind them (no deployment): the body is read before a request counts as in flight,
a slow body gets 408, a wrong key 401, and both close the connection; a connection slow with its
headers or idle between requests is closed."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from common.infra import free_port
from services.gateway.door import Admission, ApiKeys, BodyReader, BodyRules
from services.gateway.server import header_deadline_protocol

FLOOR = 0.5  # seconds: body floor, header and keep-alive timeouts alike


class Door:
    """The gateway's door stack around an app that answers with the length of the body it got."""

    def __init__(self) -> None:
        async def echo(scope, receive, send) -> None:
            message = await receive()
            body = json.dumps({"got": len(message.get("body", b""))}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})

        # One request in flight at most: a slow body that took the place would turn the next away.
        self.admission = Admission(echo, limit=lambda: 1, full=lambda: None, on_change=lambda n: None)
        reader = BodyReader(self.admission, BodyRules(max_bytes=1 << 20, floor_s=FLOOR, per_mb_s=1.0))
        self.app = ApiKeys(reader, keys={"k1"}, operator="op-key")


@pytest.fixture(scope="module")
def door() -> Iterator[tuple[Door, tuple[str, int]]]:
    door, port = Door(), free_port()
    config = uvicorn.Config(
        door.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
        http=header_deadline_protocol(FLOOR), timeout_keep_alive=FLOOR,  # type: ignore[arg-type]
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield door, ("127.0.0.1", port)
    server.should_exit = True
    thread.join(10)


def request(path: str, body: bytes, length: int | None = None, key: str = "k1") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
    head += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    return head.encode() + body


def until_closed(sock: socket.socket, within: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed. A reset
    is a close too: a byte the client sent after the server closed (on busy cores, a slow
    client's last byte can cross the server's timeout) is answered with one."""
    sock.settimeout(within)
    got, started = b"", time.monotonic()
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got, time.monotonic() - started


def test_a_request_counts_as_in_flight_only_once_its_body_is_in(door):
    app, addr = door
    with socket.create_connection(addr) as slow:
        slow.sendall(request("/v1/completions", b'{"a"', length=100))
        time.sleep(FLOOR / 5)  # the server has the headers and part of the body
        assert app.admission.in_flight == 0
        with socket.create_connection(addr) as whole:
            whole.sendall(request("/v1/completions", b'{"a": 1}'))
            reply = b""
            while b"}" not in reply:  # the headers and the body may come in two reads
                reply += whole.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200") and b'{"got": 8}' in reply
        reply, after = until_closed(slow)
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply.lower()
    assert b'"body_timeout"' in reply and after < 2


def test_a_wrong_key_is_401_and_the_unread_body_cannot_follow(door):
    _, addr = door
    with socket.create_connection(addr) as sock:
        sock.sendall(request("/v1/completions", b"{", length=1000, key="nope"))
        reply, _ = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" in reply.lower()


def test_the_operator_key_opens_the_cluster_view_and_nothing_else(door):
    _, addr = door

    def status(path: str, key: str) -> bytes:
        with socket.create_connection(addr) as sock:
            sock.sendall(request(path, b"{}", key=key))
            return sock.recv(65536)[:12]

    assert status("/v1/cluster", "op-key") == b"HTTP/1.1 200"
    assert status("/v1/cluster", "k1") == b"HTTP/1.1 200"
    assert status("/v1/completions", "op-key") == b"HTTP/1.1 401"
    assert status("/v1/cluster", "op") == b"HTTP/1.1 401"
    assert status("/v1/cluster", "\u00ff\u00e9") == b"HTTP/1.1 401"  # any bytes: refused, not a crash


def test_a_connection_slow_with_its_headers_or_idle_is_closed(door):
    _, addr = door
    with socket.create_connection(addr) as half:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(5):  # a byte now and then does not keep it open
            time.sleep(FLOOR / 5)
            half.sendall(b"X")
        reply, after = until_closed(half)
    assert reply == b"" and after < 2
    with socket.create_connection(addr) as idle:
        idle.sendall(request("/v1/completions", b"{}"))
        reply, after = until_closed(idle)
    assert reply.startswith(b"HTTP/1.1 200") and after < 2  # answered, then closed once idle


def test_a_body_past_the_cap_is_413_and_closes_the_connection(door):
    _, addr = door
    with socket.create_connection(addr) as sock:
        sock.sendall(request("/v1/completions", b"{", length=2 << 20))
        reply, _ = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
    assert b"1 MB limit" in reply
