"""One E+P+D request is one trace: the deployment exports its spans over OTLP/HTTP
(TRIDENT_OTLP_ENDPOINT) to a collector this test runs, which decodes them with the OTLP protobuf
types. The client's traceparent is continued by the gateway's span, under which the encode, the
features' pull (E→P), the prefill, the KV's pull (P→D) and the decode each leave a span, from the
instance that did it; the client's X-Request-Id is echoed."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.deploy import running_cluster
from tests.helpers.chat import user_message
from tests.helpers.images import data_url, make_image

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass(frozen=True)
class Received:
    """One span as the collector decoded it."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    instance: str
    attributes: dict


class Collector:
    """An OTLP/HTTP trace receiver on loopback: POST /v1/traces, protobuf in, protobuf out."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                request = ExportTraceServiceRequest()
                request.ParseFromString(data)
                collector.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.changed:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: _value(a.value) for a in span.attributes}
                        self.spans.append(
                            Received(
                                span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                                resource.get("service.name", ""), resource.get("service.instance.id", ""),
                                attributes,
                            )
                        )  # fmt: skip
            self.changed.notify_all()

    def wait_for(self, done: Callable[[list[Received]], bool], timeout: float) -> list[Received]:
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.spans), timeout), f"spans so far: {self.spans}"
            return list(self.spans)

    @contextmanager
    def running(self) -> Iterator[Collector]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


def _value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


STAGES = ["decode", "encode", "prefill", "transfer", "transfer"]


def test_one_e_p_d_request_is_one_trace_from_the_gateway_through_every_stage(tiny_model_dir, tmp_path):
    env = {"TRIDENT_OTLP_ENDPOINT": "", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with Collector().running() as collector:
        env["TRIDENT_OTLP_ENDPOINT"] = collector.url
        with running_cluster(tiny_model_dir, tmp_path, "e+p+d", env=env) as cluster:
            body = {
                "model": "tiny-llava", "max_tokens": 4,
                "messages": user_message([data_url(make_image(7))], "What is in the picture?"),
            }  # fmt: skip
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "trace-me-1"}
            reply = httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-request-id"] == "trace-me-1"

            def complete(spans: list[Received]) -> bool:
                ours = [s.name for s in spans if s.trace_id == CLIENT_TRACE]
                return "POST /v1/chat/completions" in ours and sorted(set(ours) - {"transfer"}) == [
                    "POST /v1/chat/completions", "decode", "encode", "prefill",
                ] and ours.count("transfer") == 2  # fmt: skip

            spans = [s for s in collector.wait_for(complete, timeout=60) if s.trace_id == CLIENT_TRACE]
    (gateway,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert gateway.parent_id == CLIENT_SPAN and gateway.service == "trident-gateway"
    assert gateway.attributes["http.request.header.x-request-id"] == ("trace-me-1",)
    assert gateway.attributes["trident.request_id"] == reply.json()["id"]
    stages = [s for s in spans if s is not gateway]
    assert sorted(s.name for s in stages) == STAGES
    assert all(s.parent_id == gateway.span_id and s.service == "trident-worker" for s in stages), stages
    assert all(s.attributes["trident.request_id"] == reply.json()["id"] for s in stages)
    where = {(s.name, s.attributes.get("trident.hop")): s.instance for s in stages}
    encoder, prefiller, decoder = where["encode", None], where["prefill", None], where["decode", None]
    assert len({encoder, prefiller, decoder}) == 3  # three instances, one trace
    assert where["transfer", "ep"] == prefiller and where["transfer", "pd"] == decoder
