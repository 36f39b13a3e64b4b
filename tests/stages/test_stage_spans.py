"""Each stage's span under the request's trace: an encode, prefill and decode instance (real engine,
NATS, Redis and transfer), each tracing into the OpenTelemetry SDK's in-memory exporter, hand one
traced request on in turn; its encode, both pulls (features E→P, KV P→D), prefill and decode spans
come out as children of the span the task carried, with the times their stage marks hold. A request
that carries no trace makes none."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.protocol import EncodeTask, PrefillTask, TraceContext
from common.roles import Role
from common.tracing import Tracing, inject
from services.worker.stage_spans import StageSpans
from tests.stages.flows import D, E, P, answer, request
from tests.stages.rig import stage_rig


def traced(rig, exporter: InMemorySpanExporter) -> None:
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "trident-worker", rig.ctx.instance_id)
    rig.ctx.spans = StageSpans(tracing, rig.ctx.instance_id)


async def test_a_traced_request_leaves_a_span_per_stage_and_pull_under_its_gateway_span(
    tiny_model_dir, nats_server, redis_server, owner
):
    exporter = InMemorySpanExporter()
    gateway = TracerProvider().get_tracer("test")
    async with (
        stage_rig(E, tiny_model_dir, nats_server, redis_server) as e,
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        for rig in (e, p, d):
            traced(rig, exporter)
        root = gateway.start_span("POST /v1/chat/completions")
        carrier = inject(trace.set_span_in_context(root))
        spec, _, _ = request(e, owner, "r-traced", num_images=1, max_tokens=5)
        spec = spec.model_copy(update={"trace": TraceContext(**carrier)})
        plain, _, _ = request(e, owner, "r-plain", num_images=0, max_tokens=3)
        stream = await e.ctx.bus.events.outputs(spec.request_id)
        await e.ctx.dispatch.send(EncodeTask(request=spec), "test")
        await e.take(Role.ENCODE)
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        assert len(await answer(stream)) == 5
        untraced = await p.ctx.bus.events.outputs(plain.request_id)
        await p.ctx.dispatch.send(PrefillTask(request=plain), "test")
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        assert len(await answer(untraced)) == 3
        for rig in (e, p, d):
            await rig.idle()
        root.end()

    spans = exporter.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == ["decode", "encode", "prefill", "transfer", "transfer"], names
    ours = root.get_span_context()
    for span in spans:
        assert span.context.trace_id == ours.trace_id and span.parent.span_id == ours.span_id, span.name
        assert span.attributes["trident.request_id"] == "r-traced"
        assert span.start_time <= span.end_time
    by = {(s.name, s.attributes.get("trident.hop")): s for s in spans}
    encode, ep, prefill = by["encode", None], by["transfer", "ep"], by["prefill", None]
    pd, decode = by["transfer", "pd"], by["decode", None]
    assert encode.resource.attributes["service.instance.id"] == e.ctx.instance_id
    assert {
        pd.resource.attributes["service.instance.id"],
        decode.resource.attributes["service.instance.id"],
    } == {d.ctx.instance_id}
    assert encode.end_time <= ep.start_time <= ep.end_time <= prefill.start_time
    assert prefill.start_time <= pd.start_time <= pd.end_time <= decode.start_time
    assert ep.attributes["trident.bytes"] > 0 and pd.attributes["trident.bytes"] > 0
    assert decode.attributes["trident.output_tokens"] == 5
