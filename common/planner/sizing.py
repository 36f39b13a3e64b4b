"""How many instances a load needs: the fewest whose best split (Algorithm 2, algorithm.py) serves
`rate` requests per second with the attainment the SLO asks for.

Goodput grows with the instance count, so the count is found by doubling from 3 until the rate is
served, then bisecting between the last count that fell short and the first that did not: a few
plans, each of which splits its count the usual way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.planner.algorithm import NoSplit, Progress, plan
from common.planner.limits import MIN_INSTANCES
from common.planner.profiles import ProfileSet
from common.planner.simulator import Correction
from common.planner.types import Deployment, PlanResult
from common.stats import SLO


class OutOfReach(ValueError):
    """Even the most instances allowed do not serve the rate; `best` is what the most do."""

    def __init__(self, message: str, best: Sizing | None = None) -> None:
        super().__init__(message)
        self.best = best


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
    trace: Sequence,
    profiles: ProfileSet,
    slo: SLO,
    rate: float,
    max_instances: int = 64,
    exhaustive: bool | None = None,
    progress: Progress | None = None,
    allowed: Callable[[Deployment], bool] | None = None,
    min_instances: int = MIN_INSTANCES,
    correction: Correction | None = None,
) -> Sizing:
    """The fewest instances (≤ `max_instances`) whose best split serves `rate` req/s, among the
    deployments `allowed` accepts; OutOfReach (with the best the most instances do) if none."""
    if rate <= 0:
        raise ValueError("the rate to serve must be above 0 requests/s")
    min_instances = max(MIN_INSTANCES, min_instances)
    if max_instances < min_instances:
        raise OutOfReach(f"the limits allow at most {max_instances} instances; a plan needs {min_instances}")
    results: dict[int, PlanResult | None] = {}

    def serves(n: int) -> bool:
        if progress is not None:
            progress(0.0, f"planning {n} instances")
        try:
            results[n] = plan(
                trace, profiles, slo, n, exhaustive=exhaustive, allowed=allowed, correction=correction
            )
        except NoSplit:
            results[n] = None  # no allowed deployment of this size
        return results[n] is not None and results[n].goodput >= rate

    short, enough = min_instances - 1, None
    n = min_instances
    while enough is None:
        if serves(n):
            enough = n
        elif n >= max_instances:
            found = {k: r for k, r in results.items() if r is not None}
            top = max(found, key=lambda k: (found[k].goodput, -k), default=None)
            best = None if top is None else Sizing(top, rate, found[top], _goodputs(results))
            most = 0.0 if best is None else best.result.goodput
            raise OutOfReach(
                f"{max_instances} instances serve at most {most:.3g} req/s within the SLOs; "
                f"{rate:g} req/s needs more (raise the instance limit or budget, or relax the SLOs)",
                best,
            )
        else:
            short, n = n, min(2 * n, max_instances)
    while enough - short > 1:
        middle = (short + enough) // 2
        short, enough = (short, middle) if serves(middle) else (middle, enough)
    return Sizing(enough, rate, results[enough], _goodputs(results))


def _goodputs(results: dict[int, PlanResult | None]) -> dict[int, float]:
    return {k: r.goodput for k, r in results.items() if r is not None}
