"""Tracing a request across its stages: W3C trace context in, OpenTelemetry spans out over OTLP/HTTP.

The gateway reads a client's `traceparent` (and `tracestate`), opens its span under it and puts
that span's context into the request (`RequestSpec.trace`), which every stage task carries; each
stage's span is then a child of the gateway's, under the client's trace id.

Spans are exported when an endpoint is configured: TRIDENT_OTLP_ENDPOINT, or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT (the SDK's other OTEL_* variables
apply: sampler, headers, timeout, service name). With none, nothing of the SDK is imported and a
span costs one attribute check; a client's trace context still passes through to the stages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

log = logging.getLogger(__name__)
PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent and tracestate, nothing else
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def extract(carrier: Mapping[str, str]) -> Context:
    """The trace context in `carrier` (HTTP headers, lower-case; or a task's `trace`); a malformed
    `traceparent` is ignored, as W3C asks: the request starts a trace of its own."""
    return PROPAGATOR.extract(carrier)


def inject(context: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the span current in `context`; empty if there is none."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    return carrier


def otlp_endpoint(configured: str) -> str | None:
    """Where spans go: TRIDENT_OTLP_ENDPOINT (a base URL, /v1/traces added, as the standard
    variable's), else "" when a standard OTEL_ variable names one (the exporter reads it), else None:
    no tracing. OTEL_SDK_DISABLED=true turns it off whatever is set."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if configured:
        return configured.rstrip("/") + "/v1/traces"
    return "" if any(os.environ.get(v) for v in ENDPOINT_VARIABLES) else None


class Tracing:
    """A service's tracer, or none. `tracer` is None when tracing is off: callers check it first,
    and that check is all tracing then costs."""

    def __init__(self, provider: TracerProvider | None = None, scope: str = "trident") -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(scope) if provider is not None else None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def configured(cls, endpoint: str, service: str, instance: str) -> Tracing:
        """Spans exported over OTLP/HTTP in batches (a background thread) when `otlp_endpoint`
        finds an endpoint; off otherwise."""
        url = otlp_endpoint(endpoint)
        if url is None:
            return cls.off()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=url or None)
        log.info("exporting spans over OTLP/HTTP to %s", url or "the OTEL_EXPORTER_OTLP_* endpoint")
        return cls.with_processor(BatchSpanProcessor(exporter), service, instance)

    @classmethod
    def with_processor(cls, processor: SpanProcessor, service: str, instance: str) -> Tracing:
        """Spans handed to `processor` (a test's in-memory exporter, or the OTLP batcher)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        attributes = {"service.instance.id": instance}
        if not os.environ.get("OTEL_SERVICE_NAME"):  # the standard variable names it, if set
            attributes["service.name"] = service
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(processor)
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is batched and stop (blocking: at most the exporter's timeout)."""
        if self.provider is not None:
            self.provider.shutdown()


def span_context_of(carrier: Mapping[str, str]) -> trace.SpanContext:
    """The span context a carrier names (invalid when it names none)."""
    return trace.get_current_span(extract(carrier)).get_span_context()
