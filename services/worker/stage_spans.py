"""Each stage's span (common/tracing.py): opened under the request's trace context, which its task
carries (`RequestSpec.trace`), as a child of the gateway's span, from the stage marks the handler
made (the same moments its histograms measure, stage_metrics.py), when the stage is over.

Spans are made afterwards with the marks' times rather than held open: a request that fails or is
cancelled mid-stage leaves no span open, and one that is not traced, or an instance that does not
trace, costs a check.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind

from common.store import Stage
from common.tracing import Tracing, extract
from services.worker.ledger import Held

KINDS = {"transfer": SpanKind.CLIENT}  # a pull from a peer; a stage is the work its task asked for


class StageSpans:
    def __init__(self, tracing: Tracing, instance: str) -> None:
        self.tracing = tracing
        self.instance = instance

    @classmethod
    def off(cls) -> StageSpans:
        return cls(Tracing.off(), "")

    def record(
        self, held: Held, name: str, start: Stage, end: Stage | None = None, **attributes: str | int
    ) -> None:
        """A span `name` from the mark `start` to the mark `end` (now, when None); nothing when the
        request is not traced, tracing is off, or `start` was not marked here."""
        tracer, context = self.tracing.tracer, held.spec.trace
        if tracer is None or context is None or start not in held.marks:
            return
        ended = held.marks.get(end, time.time()) if end is not None else time.time()
        span = tracer.start_span(
            name, context=extract(context.carrier()), kind=KINDS.get(name, SpanKind.CONSUMER),
            start_time=_ns(held.marks[start]),
            attributes={"trident.request_id": held.request_id, "trident.instance": self.instance,
                        **{f"trident.{k}": v for k, v in attributes.items()}},
        )  # fmt: skip
        span.end(end_time=_ns(max(ended, held.marks[start])))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
