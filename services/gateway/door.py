"""What a request meets before any work is done for it, as ASGI middleware around the app:

1. `ApiKeys` — the Bearer key, when keys are configured (401, closing the connection: the body
   is not read);
2. `BodyReader` — the whole body, read before anything counts the request: at most `max_bytes`
   (413) and within a deadline that grows with its size (408); either refusal closes the
   connection, so a client cannot go on sending into it or hold it open;
3. `Admission` — a place among the requests in flight, and room in the stage queues (429 with
   Retry-After): taken once the body is in, with no await between the check and the count, and
   given back when the response has been sent.

A client that sends its body slowly therefore holds a connection for at most the body deadline
and never an in-flight slot. Each middleware answers in the OpenAI error shape itself; the app
never sees what they turn away. How long a connection may take over its headers, and stay idle
between requests, is the HTTP server's part (services/gateway/server.py).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import APIError, error_response

MB = 1 << 20


def _guarded(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith("/v1/")


async def refuse(scope: Scope, receive: Receive, send: Send, exc: APIError, close: bool = False) -> None:
    """Answer `exc`; with `close`, with `Connection: close`, after which the server closes the
    connection (uvicorn's h11 protocol does once such a response is sent)."""
    response = error_response(exc)
    if close:
        response.headers["Connection"] = "close"
    await response(scope, receive, send)


OPERATOR_PATHS = ("/v1/cluster",)  # the operator's key opens them as an API key does


def bearer(headers: list[tuple[bytes, bytes]]) -> str:
    return dict(headers).get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()


def is_key(given: str, key: str) -> bool:
    """`given` is `key` (in constant time; any characters, compared as bytes)."""
    return bool(key) and hmac.compare_digest(given.encode(), key.encode())


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: set[str], operator: str = "") -> None:
        self.app = app
        self.keys = keys
        self.operator = operator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["arrived"] = time.perf_counter()  # a request's TTFT counts from here
        given = bearer(scope["headers"])
        # The operator's key came: its paths show it more than others (app.py: /v1/cluster).
        state["operator"] = scope["path"] in OPERATOR_PATHS and is_key(given, self.operator)
        if self.keys and _guarded(scope) and given not in self.keys and not state["operator"]:
            # Its body is not read: closing the connection keeps the client from trickling it in.
            wrong = APIError(401, "missing or invalid API key", code="invalid_api_key")
            await refuse(scope, receive, send, wrong, close=True)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class BodyRules:
    """How large a body may be and how fast it must come: all of it within
    `floor_s + per_mb_s × its size in MB` of the headers. The size is the declared Content-Length,
    or, for a chunked body, what has come so far — so a chunked body must keep that pace."""

    max_bytes: int = 64 * MB
    floor_s: float = 5.0
    per_mb_s: float = 2.0

    def allowed_s(self, size: int) -> float:
        return self.floor_s + self.per_mb_s * size / MB

    def too_large(self) -> APIError:
        message = f"request body is larger than the {self.max_bytes >> 20} MB limit; send large images by URL"
        return APIError(413, message, code="body_too_large")

    def too_slow(self, received: int, declared: int | None, waited: float) -> APIError:
        of = f" of {declared:,}" if declared is not None else ""
        message = (
            f"the request body did not arrive in time: {received:,}{of} bytes in {waited:.1f} s, where "
            f"{self.floor_s:g} s plus {self.per_mb_s:g} s per MB is allowed; send it faster"
        )
        return APIError(408, message, code="body_timeout")


class BodyReader:
    """Reads the whole body before the app (and `Admission`) sees the request, then hands it on as
    one message; later `receive()` calls go to the server, so a client's disconnect is still seen."""

    def __init__(self, app: ASGIApp, rules: BodyRules) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(raw) if raw.isdigit() else None
        if declared is not None and declared > self.rules.max_bytes:
            await refuse(scope, receive, send, self.rules.too_large(), close=True)
            return
        body = await self._read(scope, receive, send, declared)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> bytes | None:
        """The body, or None once the request has been answered (413, 408) or its client has gone."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks: list[bytes] = []
        received = 0
        while True:
            allowed = self.rules.allowed_s(declared if declared is not None else received)
            try:
                async with asyncio.timeout_at(started + allowed):
                    message = await receive()
            except TimeoutError:
                late = self.rules.too_slow(received, declared, loop.time() - started)
                await refuse(scope, receive, send, late, close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.rules.max_bytes:
                await refuse(scope, receive, send, self.rules.too_large(), close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class Admission:
    """At most `limit()` requests in flight, and none while a stage queue is full (`full()` names it)."""

    def __init__(
        self,
        app: ASGIApp,
        limit: Callable[[], int],
        full: Callable[[], str | None],
        on_change: Callable[[int], None],
    ) -> None:
        self.app = app
        self.limit = limit
        self.full = full
        self.on_change = on_change
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (_guarded(scope) and scope["method"] == "POST"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit():
            message = f"{self.in_flight} requests in flight, the most this gateway takes; retry shortly"
            busy = APIError(429, message, code="queue_full", retry_after=1)
            await refuse(scope, receive, send, busy)
            return
        if role := self.full():
            busy = APIError(429, f"the {role} queue is full; retry shortly", code="queue_full", retry_after=2)
            await refuse(scope, receive, send, busy)
            return
        self.in_flight += 1
        self.on_change(self.in_flight)
        try:
            await self.app(scope, receive, send)  # returns once the response (a stream too) is sent
        finally:
            self.in_flight -= 1
            self.on_change(self.in_flight)
            if on_end := scope.get("state", {}).get("on_end"):  # the request's own end (reply.py)
                await on_end()
