"""What KEDA sets a Deployment's replicas to from one reading of a ScaledObject's Prometheus trigger,
as KEDA documents it (keda.sh, "ScaledObject specification" and the Prometheus scaler), for tests
that follow the planner's published counts through the rendered scalers:

- a query with no series reads as 0 when `ignoreNullValues` is true (its default), and is an error
  when it is false;
- on an error (past `fallback.failureThreshold` readings), the fallback: `behavior` static (its
  default) sets `fallback.replicas`, currentReplicas keeps what runs, currentReplicasIfHigher /
  IfLower the larger / smaller of the two; with no fallback, the replicas stay as they are (the
  maintainers' account, kedacore/keda#6464);
- inactive (the value at or below `activationThreshold`, 0 by default): `minReplicaCount`;
- else an AverageValue target: ceil(value / threshold) replicas, within [max(1, min), max].

And what the trigger reads: the planner's published counts (`desired`)."""

from __future__ import annotations

import math

from services.planner.planner import Planner


def replicas(scaled: dict, value: float | None, current: int) -> int:
    spec = scaled["spec"]
    meta = spec["triggers"][0]["metadata"]
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if value is None:
        if meta.get("ignoreNullValues", "true") == "true":
            value = 0.0
        elif (fallback := spec.get("fallback")) is not None:
            return {
                "static": fallback["replicas"],
                "currentReplicas": current,
                "currentReplicasIfHigher": max(current, fallback["replicas"]),
                "currentReplicasIfLower": min(current, fallback["replicas"]),
            }[fallback.get("behavior", "static")]
        else:
            return current
    if value <= float(meta.get("activationThreshold", 0)):
        return low
    return min(high, max(max(1, low), math.ceil(value / float(meta["threshold"]))))


def desired(planner: Planner) -> dict[str, float]:
    """trident_planner_desired_instances as Prometheus would scrape it (absent kinds: no series)."""
    out = {}
    for metric in planner.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "trident_planner_desired_instances":
                out[sample.labels["kind"]] = sample.value
    return out
