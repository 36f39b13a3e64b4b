"""How many instances of each kind a load needs, within the deployment's limits: the one code path
behind `trident plan --rate` and the continuous planner's recommendation (its `desired` counts).

    allowed   = deployments within each kind's [minimum, maximum] and the core (or GPU) budget
    sizing    = the fewest instances whose best allowed split serves the rate (sizing.py)
    floor     = never fewer instances running a stage than run it now while that stage has tasks
                queued: a backlog is work the smaller deployment would still have to do
    desired   = sizing's counts, raised to the floor where the limits leave room

A minimum applies to a kind when the chosen method runs it (a method without E instances has none
to keep). When even the most the limits allow does not serve the rate, the recommendation is the
best of those, marked `short` with why: a planner on a small machine says so rather than ask for
replicas that would only share its cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.planner.algorithm import Progress
from common.planner.limits import KINDS, Limits
from common.planner.profiles import ProfileSet
from common.planner.simulator import Correction
from common.planner.sizing import OutOfReach, Sizing, size
from common.planner.types import KIND_ROLES, Deployment
from common.roles import Role
from common.stats import SLO


@dataclass
class Capacity:
    """A recommendation: the instances of each kind to run for `rate`, and how it was reached."""

    rate: float  # requests/s planned for
    deployment: Deployment
    goodput: float  # predicted for the deployment before any floor was added
    sizing: Sizing
    cost: float
    limits: Limits
    short: str | None = None  # why the limits cannot serve the rate (then: the best they allow)
    held: dict[str, int] = field(default_factory=dict)  # instances kept for queued work, per kind

    @property
    def desired(self) -> dict[str, int]:
        """Every kind's count (0 for those the method does not run)."""
        counts = self.deployment.counts
        return {kind: counts.get(kind, 0) for kind in KINDS}

    def to_dict(self) -> dict:
        return {
            "rate": round(self.rate, 6),
            "method": self.deployment.method,
            "label": self.deployment.label,
            "desired": self.desired,
            "instances": self.deployment.instances,
            "predicted_goodput": self.goodput,
            "cost": self.cost,
            "budget": self.limits.budget,
            "unit": self.limits.unit,
            "short": self.short,
            "held_for_queued_work": self.held,
            "tried": {str(n): g for n, g in sorted(self.sizing.tried.items())},
        }


def recommend(
    trace: Sequence,
    profiles: ProfileSet,
    slo: SLO,
    rate: float,
    limits: Limits,
    *,
    queued: Mapping[Role, int] | None = None,
    running: Mapping[str, int] | None = None,
    correction: Correction | None = None,
    exhaustive: bool | None = None,
    progress: Progress | None = None,
) -> Capacity:
    """The instances to run for `rate` req/s. `queued` (tasks waiting per stage) and `running` (live
    instances per kind) set the floor; without them there is none."""
    fewest, most = limits.instance_range()
    short = None
    try:
        sizing = size(
            trace,
            profiles,
            slo,
            rate,
            most,
            exhaustive,
            progress,
            allowed=limits.allows,
            min_instances=fewest,
            correction=correction,
        )
    except OutOfReach as exc:
        if exc.best is None:
            raise
        sizing = exc.best
        best = sizing.result
        within = (
            f"within a budget of {limits.budget:g} {limits.unit}" if limits.budget else "within the limits"
        )
        short = (
            f"{rate:.3g} req/s needs more than fits {within}: the most that fits, "
            f"{best.deployment.label}, serves {best.goodput:.3g} req/s within the SLOs"
        )
    deployment = sizing.result.deployment
    floored, held = _floor(deployment, queued or {}, running or {}, limits)
    return Capacity(
        rate, floored, sizing.result.goodput, sizing, limits.cost_of(floored), limits, short, held
    )


def _floor(
    deployment: Deployment, queued: Mapping[Role, int], running: Mapping[str, int], limits: Limits
) -> tuple[Deployment, dict[str, int]]:
    """Raise `deployment` so that each stage with queued tasks keeps at least as many instances
    running it as run it now, adding to the kind of the method that runs that stage."""
    counts = deployment.counts
    held: dict[str, int] = {}
    for role, waiting in queued.items():
        if waiting <= 0:
            continue
        now = sum(n for kind, n in running.items() if role in KIND_ROLES[kind])
        kind = next(k for k in counts if role in KIND_ROLES[k])
        have = sum(n for k, n in counts.items() if role in KIND_ROLES[k])
        while have < now:
            trial = Deployment.of(deployment.method, **{**counts, kind: counts[kind] + 1})
            if not limits.allows(trial):
                break
            counts, have = trial.counts, have + 1
            held[str(kind)] = held.get(str(kind), 0) + 1
    return Deployment.of(deployment.method, **counts), held
