"""The planner's Prometheus gauges: what it recommends and how it got there."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.planner.types import KIND_ROLES, METHOD_KINDS, PlanResult
from common.protocol import Plan
from services.planner.capacity import CapacityDecision


@dataclass
class Metrics:
    registry: CollectorRegistry
    replicas: Gauge
    method: Gauge
    goodput: Gauge
    attainment: Gauge
    decision_id: Gauge
    duration: Gauge
    window: Gauge
    distance: Gauge
    plans: Counter
    desired: Gauge
    forecast: Gauge
    short: Gauge

    @classmethod
    def create(cls) -> Metrics:
        r = CollectorRegistry()
        m = cls(
            r,
            Gauge(
                "trident_planner_recommended_replicas",
                "Instances of each kind the current plan recommends (0: not in its method)",
                ["role"],
                registry=r,
            ),
            Gauge(
                "trident_planner_method",
                "1 for the recommended method, 0 for the others",
                ["method"],
                registry=r,
            ),
            Gauge(
                "trident_planner_predicted_goodput",
                "Requests/s the plan is predicted to serve in SLO",
                registry=r,
            ),
            Gauge(
                "trident_planner_predicted_attainment", "SLO attainment predicted at that rate", registry=r
            ),
            Gauge("trident_planner_decision_id", "Decision id of the current plan (0: none yet)", registry=r),
            Gauge(
                "trident_planner_plan_duration_seconds", "How long the last plan took to compute", registry=r
            ),
            Gauge("trident_planner_trace_window", "Finished requests held for planning", registry=r),
            Gauge(
                "trident_planner_workload_distance",
                "Distance of the requests since the last plan from those it was made for",
                registry=r,
            ),
            Counter("trident_planner_plans", "Plans made, by what triggered them", ["trigger"], registry=r),
            Gauge(
                "trident_planner_desired_instances",
                "Instances of each kind that serve the forecast load within the SLOs and limits",
                ["kind"],
                registry=r,
            ),
            Gauge(
                "trident_planner_forecast_rate",
                "Requests/s capacity is sized for (Holt forecast)",
                registry=r,
            ),
            Gauge(
                "trident_planner_capacity_short",
                "1 when the most the budget and limits allow does not serve the forecast load",
                registry=r,
            ),
        )
        for kind in KIND_ROLES:
            m.replicas.labels(kind).set(0)
        # No desired count until one is known (planner.py: what runs, the deployment's starting
        # method, or a sizing): an autoscaler reads a missing series as "keep what runs", and 0 as
        # "stop everything".
        for method in METHOD_KINDS:
            m.method.labels(method).set(0)
        return m

    def record_capacity(self, sized: CapacityDecision) -> None:
        """The sizing's figures; its desired counts are published by `publish_desired` (planner.py
        hands them over first, common/planner/handover.py)."""
        self.forecast.set(sized.forecast.rate)
        if sized.capacity is None:  # nothing fits the limits: the desired counts are left as they were
            self.short.set(1)
            return
        self.short.set(1 if sized.capacity.short else 0)

    def publish_desired(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            self.desired.labels(kind).set(n)

    def record(self, plan: Plan, result: PlanResult, duration: float, trigger: str) -> None:
        for kind in KIND_ROLES:
            self.replicas.labels(kind).set(plan.replicas.get(kind, 0))
        for method in METHOD_KINDS:
            self.method.labels(method).set(1 if method == plan.method else 0)
        self.goodput.set(result.goodput)
        self.attainment.set(result.attainment)
        self.decision_id.set(plan.decision_id)
        self.duration.set(duration)
        self.plans.labels(trigger).inc()
