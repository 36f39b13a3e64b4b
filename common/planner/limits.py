"""What a capacity recommendation must fit (capacity.py): per-kind replica bounds and a core or GPU
budget. Kept apart from the planner's heavy modules: the services' settings parse these."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.planner.types import METHOD_KINDS, Deployment
from common.roles import InstanceKind

MIN_INSTANCES = 2  # the fewest Algorithm 2 splits: EP+D or ED+P (sizing.py)
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
    cost: float = 1.0  # what one instance takes of the budget
    unit: str = "cores"
    max_instances: int = 64  # search bound when nothing else bounds it

    def __post_init__(self) -> None:
        for kind, low in self.minimum.items():
            if (high := self.maximum.get(kind)) is not None and high < low:
                raise ValueError(f"limits: {kind} has minimum {low} above its maximum {high}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"limits: the budget must be above 0 {self.unit}")
        if self.cost <= 0:
            raise ValueError("limits: an instance's cost must be above 0")

    def cost_of(self, deployment: Deployment) -> float:
        return deployment.instances * self.cost

    def allows(self, deployment: Deployment) -> bool:
        """Each kind within its bounds, and all instances within the budget."""
        for kind, n in deployment.replicas:
            if n < self.minimum.get(kind, 0) or n > self.maximum.get(kind, n):
                return False
        return self.budget is None or self.cost_of(deployment) <= self.budget + 1e-9

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
            most = min(most, math.floor(self.budget / self.cost + 1e-9))
        return max(MIN_INSTANCES, min(lows)), most
