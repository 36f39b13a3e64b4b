"""What keeps a continuous plan honest: noticing that the workload moved away from the one planned
for, and correcting the simulator's predictions by what the cluster actually measured."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from common.planner.profiles import ProfileSet
from common.planner.simulator import Correction, simulate
from common.planner.trace import rate
from common.planner.types import KIND_ROLES, METHOD_KINDS, Deployment
from common.stats import SLO

MIN_MEASURED = 20  # requests with measured latencies needed before a correction is trusted
CORRECTION_RANGE = (0.25, 4.0)

_FEATURES: dict[str, Callable] = {
    "prompt_tokens": lambda e: e.prompt_tokens,
    "image_tokens": lambda e: e.image_tokens,
    "num_images": lambda e: e.num_images,
    "output_tokens": lambda e: e.output_tokens,
}


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sample Kolmogorov–Smirnov statistic: the largest gap between the empirical CDFs."""
    if not a or not b:
        return 0.0
    xa, xb = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.union1d(xa, xb)
    cdf_a = np.searchsorted(xa, grid, side="right") / len(xa)
    cdf_b = np.searchsorted(xb, grid, side="right") / len(xb)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def workload_distance(recent: Sequence, planned_for: Sequence) -> float:
    """How far the recent requests are from those the current plan was made for, in [0, 1]: the
    largest KS statistic over the request sizes, or the rate's change (a doubling or halving is 1)."""
    if not recent or not planned_for:
        return 1.0 if recent or planned_for else 0.0
    size = max(ks_statistic([f(e) for e in recent], [f(e) for e in planned_for]) for f in _FEATURES.values())
    r_new, r_old = rate(recent), rate(planned_for)
    rate_shift = min(1.0, abs(math.log2(r_new / r_old))) if r_new > 0 and r_old > 0 else 0.0
    return max(size, rate_shift)


def kind_counts(role_sets: Iterable[Iterable[str]]) -> Counter[str]:
    """Instances per kind, from their role sets; a set no kind has counts under ""."""
    by_roles = {roles: kind for kind, roles in KIND_ROLES.items()}
    return Counter(by_roles.get(frozenset(roles), "") for roles in role_sets)


def current_deployment(role_sets: Iterable[Iterable[str]]) -> Deployment | None:
    """The deployment the live instances form (their role sets), or None if they form no single method."""
    kinds = kind_counts(role_sets)
    if "" in kinds:
        return None
    for method, method_kinds in METHOD_KINDS.items():
        if set(kinds) == set(method_kinds):
            return Deployment.of(method, **kinds)
    return None


def measure_correction(recent: Sequence, current: Deployment, profiles: ProfileSet, slo: SLO) -> Correction:
    """Observed/predicted ratios of TTFT (medians) and TBT (p90s) over the recent requests that carry
    measurements, by replaying them on the deployment that served them. Neutral until enough exist;
    clamped so one bad window cannot swing a plan by more than 4×."""
    measured = [e for e in recent if e.ttft is not None]
    if len(measured) < MIN_MEASURED:
        return Correction()
    predicted = simulate(measured, current, profiles, slo)
    observed_ttft = float(np.median([e.ttft for e in measured]))
    predicted_ttft = float(np.nanmedian(predicted.ttft))
    tbts = [e.tbt_p90 for e in measured if e.tbt_p90]
    predicted_tbts = predicted.tbt_p90[predicted.tbt_p90 > 0]
    ttft = _ratio(observed_ttft, predicted_ttft)
    tbt = (
        _ratio(float(np.median(tbts)), float(np.median(predicted_tbts)))
        if tbts and predicted_tbts.size
        else 1.0
    )
    return Correction(ttft=ttft, tbt=tbt)


def _ratio(observed: float, predicted: float) -> float:
    if not (predicted > 0 and math.isfinite(predicted) and math.isfinite(observed)):
        return 1.0
    low, high = CORRECTION_RANGE
    return round(min(high, max(low, observed / predicted)), 4)
