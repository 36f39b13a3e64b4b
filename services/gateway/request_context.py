"""A request's identity at the gateway, as ASGI middleware outside the door (door.py):

- its `X-Request-Id`: the client's when sane (SANE_ID), else one made here; echoed on every answer,
  refusals included, and named in every log line the gateway writes while serving it;
- its trace: the client's W3C `traceparent` and `tracestate`, under which the gateway opens its span
  when tracing is on (common/tracing.py). The span covers the whole answer, a stream to its end.
  The context the stages get (`trace_of`) is that span's, or the client's passed through when
  tracing is off here: a worker that traces still joins the client's trace.

The completion's own id (`chatcmpl-…`), which keys the request in the deployment, stays the
gateway's: a client's id need not be unique (a retry resends it), and two requests sharing a key
would share their records and task de-duplication. The span carries both.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.protocol import TraceContext
from common.protocol.tasks import TRACESTATE_MAX
from common.tracing import Tracing, extract, inject

SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # safe in a header and a log line
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Puts the X-Request-Id of the request being served (or "-") on each record: `%(request_id)s`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def request_id(given: str) -> str:
    """The client's id if it is sane, else a new one."""
    return given if SANE_ID.fullmatch(given) else os.urandom(16).hex()


def trace_of(state: dict) -> TraceContext | None:
    """The trace context the request's stage tasks carry (None: the request is not traced)."""
    carrier = state.get("trace") or {}
    if "traceparent" not in carrier:
        return None
    tracestate = carrier.get("tracestate", "")
    return TraceContext(
        traceparent=carrier["traceparent"], tracestate=tracestate if len(tracestate) <= TRACESTATE_MAX else ""
    )


class RequestContext:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id(headers.get("x-request-id", ""))
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        span, tracer = None, self.tracing.tracer
        # A completion (or its refusal) is traced when tracing is on here, or its client traces it.
        if (
            scope["method"] == "POST"
            and scope["path"].startswith("/v1/")
            and (tracer or "traceparent" in headers)
        ):
            parent = extract(headers)
            if tracer is not None:
                span = tracer.start_span(
                    f"POST {scope['path']}", context=parent, kind=SpanKind.SERVER,
                    attributes={"http.request.method": "POST", "url.path": scope["path"],
                                "http.request.header.x-request-id": (rid,)},
                )  # fmt: skip
            state["trace"] = inject(trace.set_span_in_context(span, parent) if span is not None else parent)
        status = 500  # unless a response starts
        echoed = rid.encode()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", echoed)]
            await send(message)

        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if completion := state.get("completion_id"):
                    span.set_attribute("trident.request_id", completion)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
                span.end()
