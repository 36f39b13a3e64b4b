"""What a request meets before any work is done for it, as ASGI middleware around the app:

1. `ApiKeys` — the Bearer key, when keys are configured (401);
2. `Admission` — a place among the requests in flight, and room in the stage queues (429 with
   Retry-After): taken before the body is read, images fetched or the prompt processed, with no
   await between the check and the count, and given back when the response has been sent;
3. `BodyLimit` — the body's size, from its Content-Length and while it streams in (413).

Each answers in the OpenAI error shape itself; the app never sees what they turn away.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import APIError, error_response


def _guarded(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith("/v1/")


async def refuse(scope: Scope, receive: Receive, send: Send, exc: APIError) -> None:
    await error_response(exc)(scope, receive, send)


class ApiKeys:
    def __init__(self, app: ASGIApp, keys: set[str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrived"] = (
                time.perf_counter()
            )  # a request's TTFT counts from here
        if self.keys and _guarded(scope):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth.removeprefix("Bearer ").strip() not in self.keys:
                await refuse(
                    scope, receive, send, APIError(401, "missing or invalid API key", code="invalid_api_key")
                )
                return
        await self.app(scope, receive, send)


class Admission:
    """At most `limit()` requests in flight, and none while a stage queue is full (`full()` names it)."""

    def __init__(
        self, app: ASGIApp, limit: Callable[[], int], full: Callable[[], str | None],
        on_change: Callable[[int], None],
    ) -> None:  # fmt: skip
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


class BodyLimit:
    """A body larger than `max_bytes` is refused from its Content-Length, or, sent without one, as
    soon as it grows past the limit (the app's error handlers answer the HTTPException raised)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await refuse(scope, receive, send, APIError(413, self.message, code="body_too_large"))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self.message)
            return message

        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        return f"request body is larger than the {self.max_bytes >> 20} MB limit; send large images by URL"
