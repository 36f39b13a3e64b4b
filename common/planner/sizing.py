"""How many instances a load needs: the fewest whose best split (Algorithm 2, algorithm.py) serves
`rate` requests per second with the attainment the SLO asks for.

Goodput grows with the instance count, so the count is found by doubling from 3 until the rate is
served, then bisecting between the last count that fell short and the first that did not: a few
plans, each of which splits its count the usual way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.planner.algorithm import Progress, plan
from common.planner.profiles import ProfileSet
from common.planner.types import PlanResult
from common.stats import SLO

MIN_INSTANCES = 3  # one per stage


class OutOfReach(ValueError):
    """Even the most instances allowed do not serve the rate."""


@dataclass
class Sizing:
    instances: int  # the fewest that serve the rate
    rate: float
    result: PlanResult  # the plan for that many
    tried: dict[int, float] = field(default_factory=dict)  # instance count -> its best goodput

    def to_dict(self) -> dict:
        return {
            **self.result.to_dict(),
            "rate": self.rate,
            "recommended_instances": self.instances,
            "tried": {str(n): g for n, g in sorted(self.tried.items())},
        }


def size(
    trace: Sequence, profiles: ProfileSet, slo: SLO, rate: float, max_instances: int = 64,
    exhaustive: bool | None = None, progress: Progress | None = None,
) -> Sizing:  # fmt: skip
    """The fewest instances (≤ `max_instances`) whose best split serves `rate` req/s; OutOfReach if none."""
    if rate <= 0:
        raise ValueError("the rate to serve must be above 0 requests/s")
    results: dict[int, PlanResult] = {}

    def serves(n: int) -> bool:
        if progress is not None:
            progress(0.0, f"planning {n} instances")
        results[n] = plan(trace, profiles, slo, n, exhaustive=exhaustive)
        return results[n].goodput >= rate

    short, enough = MIN_INSTANCES - 1, None
    n = MIN_INSTANCES
    while enough is None:
        if serves(n):
            enough = n
        elif n >= max_instances:
            best = results[n].goodput
            raise OutOfReach(
                f"{max_instances} instances serve at most {best:.3g} req/s within the SLOs; "
                f"{rate:g} req/s needs more (raise --max-instances, or relax the SLOs)"
            )
        else:
            short, n = n, min(2 * n, max_instances)
    while enough - short > 1:
        middle = (short + enough) // 2
        short, enough = (short, middle) if serves(middle) else (middle, enough)
    tried = {k: r.goodput for k, r in results.items()}
    return Sizing(enough, rate, results[enough], tried)
