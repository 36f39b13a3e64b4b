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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.planner.algorithm import Progress
from common.planner.profiles import ProfileSet
from common.planner.simulator import Correction
from common.planner.sizing import MIN_INSTANCES, OutOfReach, Sizing, size
from common.planner.types import METHOD_KINDS, Deployment
from common.roles import InstanceKind, Role
from common.stats import SLO

KINDS = tuple(k.value for k in InstanceKind)
PLANNED_METHODS = ("e+p+d", "ep+d", "ed+p")  # the ones Algorithm 2 splits (every_split)


def parse_counts(text: str, what: str) -> dict[str, int]:
    """`e=1,d=2` → {"e": 1, "d": 2}; a ValueError that names the bad part otherwise."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        kind = kind.strip().lower()
        if not sep or kind not in KINDS:
            raise ValueError(f"{what}: {part!r} is not KIND=COUNT with KIND one of {', '.join(KINDS)}")
        try:
            out[kind] = int(value)
        except ValueError:
            raise ValueError(f"{what}: {value.strip()!r} in {part!r} is not a whole number") from None
        if out[kind] < 0:
            raise ValueError(f"{what}: {part!r} is negative")
    return out


@dataclass(frozen=True)
class Limits:
    """What a recommendation must fit: per-kind bounds and what all instances together may take."""

    minimum: Mapping[str, int] = field(default_factory=dict)  # per kind, when its method runs it
    maximum: Mapping[str, int] = field(default_factory=dict)  # per kind; absent: no bound
    budget: float | None = None  # cores (or GPUs) for all instances; None: unbounded
    cost: Mapping[str, float] = field(default_factory=dict)  # per instance of a kind; default 1
    unit: str = "cores"
    max_instances: int = 64  # search bound when nothing else bounds it

    def __post_init__(self) -> None:
        for kind, low in self.minimum.items():
            if (high := self.maximum.get(kind)) is not None and high < low:
                raise ValueError(f"limits: {kind} has minimum {low} above its maximum {high}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"limits: the budget must be above 0 {self.unit}")
        if any(c <= 0 for c in self.cost.values()):
            raise ValueError("limits: an instance's cost must be above 0")

    def cost_of(self, deployment: Deployment) -> float:
        return sum(n * self.cost.get(kind, 1.0) for kind, n in deployment.replicas)

    def why_not(self, deployment: Deployment) -> str | None:
        """Why the limits rule `deployment` out, or None if they allow it."""
        for kind, n in deployment.replicas:
            if n < self.minimum.get(kind, 0):
                return f"{kind} below its minimum {self.minimum[kind]}"
            if (high := self.maximum.get(kind)) is not None and n > high:
                return f"{kind} above its maximum {high}"
        if self.budget is not None and self.cost_of(deployment) > self.budget + 1e-9:
            return f"{self.cost_of(deployment):g} {self.unit} exceed the budget of {self.budget:g}"
        return None

    def allows(self, deployment: Deployment) -> bool:
        return self.why_not(deployment) is None

    def instance_range(self) -> tuple[int, int]:
        """The fewest and most instances any allowed deployment can have."""
        lows, highs = [], []
        for method, kinds in METHOD_KINDS.items():
            if method not in PLANNED_METHODS:
                continue
            lows.append(sum(max(1, self.minimum.get(k, 0)) for k in kinds))
            bounded = all(k in self.maximum for k in kinds)
            highs.append(sum(self.maximum[k] for k in kinds) if bounded else self.max_instances)
        most = min(max(highs), self.max_instances)
        if self.budget is not None:
            cheapest = min(self.cost.get(k, 1.0) for k in KINDS)
            most = min(most, math.floor(self.budget / cheapest + 1e-9))
        return max(MIN_INSTANCES, min(lows)), most


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
    trace: Sequence, profiles: ProfileSet, slo: SLO, rate: float, limits: Limits, *,
    queued: Mapping[Role, int] | None = None, running: Mapping[str, int] | None = None,
    correction: Correction | None = None, exhaustive: bool | None = None,
    progress: Progress | None = None,
) -> Capacity:  # fmt: skip
    """The instances to run for `rate` req/s. `queued` (tasks waiting per stage) and `running` (live
    instances per kind) set the floor; without them there is none."""
    fewest, most = limits.instance_range()
    short = None
    try:
        sizing = size(
            trace, profiles, slo, rate, most, exhaustive, progress,
            allowed=limits.allows, min_instances=fewest, correction=correction,
        )  # fmt: skip
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
        now = sum(n for kind, n in running.items() if role in InstanceKind(kind).roles)
        kind = next(k for k in counts if role in InstanceKind(k).roles)
        have = sum(n for k, n in counts.items() if role in InstanceKind(k).roles)
        while have < now:
            trial = Deployment.of(deployment.method, **{**counts, kind: counts[kind] + 1})
            if not limits.allows(trial):
                break
            counts, have = trial.counts, have + 1
            held[str(kind)] = held.get(str(kind), 0) + 1
    return Deployment.of(deployment.method, **counts), held
