"""How Trident judges latency, computed one way everywhere: the gateway measuring its requests,
the benchmark measuring any server, the planner's simulator predicting them and the budget
governor holding a step to its target. A prediction and a measurement then mean the same thing.

A request meets its SLOs (seed 000 §2.2) when it completed, its time to first token (TTFT) is
within the TTFT objective, and the 90th percentile of its times between tokens (TBT) is within
the TBT objective; with at most one token there is no gap, and the TBT objective holds vacuously.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TBT_QUANTILE = 0.9  # the share of a request's gaps that must be within the TBT objective


@dataclass(frozen=True)
class SLO:
    """Latency objectives (seconds) and the share of requests that must meet both for a rate to count."""

    ttft: float
    tbt: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft <= 0 or self.tbt <= 0:
            raise ValueError("SLOs must be positive seconds")
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment must be in (0, 1]")


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) with linear interpolation between order statistics, as numpy's
    default method computes it. Raises ValueError for no values."""
    if not values:
        raise ValueError("the quantile of no values")
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def request_tbt(gaps: Sequence[float]) -> float | None:
    """A request's TBT as its SLO judges it: the TBT_QUANTILE of its gaps; None with no gap."""
    return quantile(gaps, TBT_QUANTILE) if gaps else None


def slo_met(ttft: float | None, tbt: float | None, slo: SLO) -> bool:
    """A completed request's verdict: a first token within the TTFT objective (None: it never came)
    and a TBT (`request_tbt`) within the TBT objective, vacuously without one."""
    return ttft is not None and ttft <= slo.ttft and (tbt is None or tbt <= slo.tbt)


def attainment(verdicts: Iterable[bool]) -> float:
    """The share of requests that met their SLOs; 0.0 for none."""
    verdicts = list(verdicts)
    return sum(verdicts) / len(verdicts) if verdicts else 0.0
