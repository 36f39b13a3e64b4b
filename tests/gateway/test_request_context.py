"""The gateway's request context (services/gateway/request_context.py) around a small ASGI app, in
process: X-Request-Id echoed (the client's when sane, else a new one) and named in the log lines
written while the request is served; a client's W3C traceparent continued by the gateway's span
when tracing is on, passed through untouched when it is off, and a malformed one ignored."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common.tracing import Tracing, span_context_of
from services.gateway.request_context import RequestContext, RequestIdFilter, trace_of

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
log = logging.getLogger("tests.request_context")


async def app(scope, receive, send) -> None:
    """Says what the request context gave it; /v1/fail answers 503 as a refusal would."""
    state = scope["state"]
    state["completion_id"] = "chatcmpl-test"
    log.warning("serving")
    status = 503 if scope["path"] == "/v1/fail" else 200
    body = json.dumps({"request_id": state["request_id"], "trace": state.get("trace")}).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RequestIdFilter())
        self.setFormatter(logging.Formatter("[%(request_id)s] %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def lines():
    handler = Lines()
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


def client(tracing: Tracing) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=RequestContext(app, tracing))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


async def test_x_request_id_is_echoed_when_sane_made_when_not_and_named_in_the_log(lines):
    async with client(Tracing.off()) as http:
        given = await http.post("/v1/chat/completions", headers={"X-Request-Id": "order-42/retry:1"})
        assert given.headers["x-request-id"] == given.json()["request_id"] == "order-42/retry:1"
        made = await http.post("/v1/chat/completions")
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
        for insane in ("has space", "x" * 129, 'quote"d', ""):
            replaced = await http.post("/v1/chat/completions", headers={"X-Request-Id": insane})
            assert re.fullmatch(r"[0-9a-f]{32}", replaced.headers["x-request-id"]), insane
        refused = await http.post("/v1/fail", headers={"X-Request-Id": "abc"})
        assert refused.status_code == 503 and refused.headers["x-request-id"] == "abc"
    assert (
        lines[0] == "[order-42/retry:1] serving" and lines[1] == f"[{made.headers['x-request-id']}] serving"
    )
    log.warning("between requests")
    assert lines[-1] == "[-] between requests"


async def test_with_tracing_off_a_clients_trace_context_passes_through_to_the_stages():
    async with client(Tracing.off()) as http:
        carried = (await http.post("/v1/completions", headers={"traceparent": TRACEPARENT})).json()["trace"]
        assert carried == {"traceparent": TRACEPARENT}
        assert trace_of({"trace": carried}).traceparent == TRACEPARENT
        none = (await http.post("/v1/completions", headers={"traceparent": "00-bogus-01"})).json()["trace"]
        assert none == {} and trace_of({"trace": none}) is None


async def test_with_tracing_on_the_gateway_span_continues_the_clients_trace_and_parents_the_stages():
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "trident-gateway", "gw-test")
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=opaque", "X-Request-Id": "abc"}
    async with client(tracing) as http:
        carried = (await http.post("/v1/chat/completions", headers=headers)).json()["trace"]
        await http.post("/v1/fail")  # no traceparent: a trace of its own
        await http.get("/v1/models")  # only completions are traced
    ok, failed = exporter.get_finished_spans()
    assert (ok.name, ok.kind) == ("POST /v1/chat/completions", SpanKind.SERVER)
    assert f"{ok.context.trace_id:032x}" == CLIENT_TRACE and f"{ok.parent.span_id:016x}" == CLIENT_SPAN
    assert ok.resource.attributes["service.name"] == "trident-gateway"
    assert ok.attributes["trident.request_id"] == "chatcmpl-test"
    assert ok.attributes["http.request.header.x-request-id"] == ("abc",)
    assert ok.attributes["http.response.status_code"] == 200
    stages = span_context_of(carried)  # what every stage task carries: the gateway's span
    assert (stages.trace_id, stages.span_id) == (ok.context.trace_id, ok.context.span_id)
    assert carried["tracestate"] == "vendor=opaque"
    assert failed.parent is None and failed.context.trace_id != ok.context.trace_id
    assert (
        failed.status.status_code == StatusCode.ERROR
        and failed.attributes["http.response.status_code"] == 503
    )
