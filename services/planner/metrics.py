"""The planner's Prometheus gauges: what it recommends and how it got there."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.planner.types import KIND_ROLES, METHOD_KINDS, PlanResult
from common.protocol import Plan


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
        )
        for kind in KIND_ROLES:
            m.replicas.labels(kind).set(0)
        for method in METHOD_KINDS:
            m.method.labels(method).set(0)
        return m

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
