"""The fixed costs of a running deployment, read from the stage marks its requests leave in the trace.

Compute latency comes from the instances' profiles; what they cannot see is the path between them:
the gateway's processing, a task's hop through the broker, a pull's fixed cost. Each is an interval
between two stage marks (common/store/requests.py `Stage`) and is taken at a low quantile over
many requests, which is what it costs when nothing queues — so the estimate holds under load too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.planner.profiles import TransferModel

QUANTILE = 10  # percent: the unloaded cost of an interval that queueing can only lengthen
MIN_SAMPLES = 5


def _interval(records: Sequence, start: str, end: str) -> float | None:
    values = [r.stages[end] - r.stages[start] for r in records if start in r.stages and end in r.stages]
    values = [v for v in values if v >= 0]
    return float(np.percentile(values, QUANTILE)) if len(values) >= MIN_SAMPLES else None


def transfer_model(records: Sequence, base: TransferModel | None = None) -> TransferModel:
    """A TransferModel whose fixed costs are measured from trace records (TraceRecord: `stages`
    wall-clock marks, optional gateway-measured `ttft`); costs with too few samples keep `base`'s."""
    base = base or TransferModel()
    queued = [_first_queued(r) for r in records]
    to_queue = [
        q - r.stages["arrival"] for r, q in zip(records, queued, strict=True) if q and "arrival" in r.stages
    ]
    # The first token's way back: what the gateway measured beyond the instance's first-token mark.
    back = [
        r.ttft - (r.stages["first_token"] - r.stages["arrival"])
        for r in records
        if getattr(r, "ttft", None) is not None and "first_token" in r.stages and "arrival" in r.stages
    ]
    dispatch = base.dispatch
    if len(to_queue) >= MIN_SAMPLES:
        dispatch = float(np.percentile(to_queue, QUANTILE))
        if len(back) >= MIN_SAMPLES:
            dispatch += max(0.0, float(np.percentile(back, QUANTILE)))
    hops = [
        h
        for h in (
            _interval(records, "encode_queued", "encode_started"),
            _interval(records, "prefill_queued", "prefill_started"),
        )
        if h is not None
    ]
    pulls = [
        p
        for p in (
            _interval(records, "ep_transfer_started", "ep_transfer_ended"),
            _interval(records, "pd_transfer_started", "pd_transfer_ended"),
        )
        if p is not None
    ]
    return TransferModel(
        latency=float(np.mean(pulls)) if pulls else base.latency,
        bandwidth=base.bandwidth,
        hop=float(np.mean(hops)) if hops else base.hop,
        dispatch=dispatch,
    )


def _first_queued(record) -> float | None:
    marks = [record.stages[k] for k in ("encode_queued", "prefill_queued") if k in record.stages]
    return min(marks) if marks else None
