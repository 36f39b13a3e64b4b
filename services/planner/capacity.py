"""The continuous planner's capacity: the forecast arrival rate, and the instances of each kind that
serve it within the limits (common/planner/capacity.py, the code `trident plan --rate` runs too).

Sized after every plan, and between plans whenever the forecast rate has moved by more than
TRIDENT_PLANNER_CAPACITY_CHANGE since the last sizing (at most once per
TRIDENT_PLANNER_CAPACITY_MIN_INTERVAL), or a plan interval has passed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.planner.capacity import Capacity
from common.planner.forecast import Forecast, ForecastConfig, forecast
from common.protocol import TraceRecord

MIN_RATE = 0.01  # req/s an idle deployment is sized for: it keeps the fewest instances the limits allow


@dataclass
class CapacityDecision:
    """One sizing and everything behind it."""

    time: float  # wall clock
    trigger: str
    forecast: Forecast
    capacity: Capacity | None  # None when no deployment fits the limits at all
    error: str | None = None  # why there is no capacity
    queued: dict[str, int] = field(default_factory=dict)  # tasks waiting per stage
    running: dict[str, int] = field(default_factory=dict)  # live instances per kind
    duration: float = 0.0
    # What was last published for an autoscaler: the desired counts handed over against what runs
    # (common/planner/handover.py); None until then.
    published: dict[str, int] | None = None

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "trigger": self.trigger,
            "forecast": self.forecast.to_dict(),
            **(self.capacity.to_dict() if self.capacity else {"desired": None}),
            "error": self.error,
            "queued": self.queued,
            "running": self.running,
            "published": self.published,
            "duration": round(self.duration, 3),
        }


def finish_lag(records: Sequence[TraceRecord]) -> float:
    """How long the recorded requests took, p90 (seconds): arrivals more recent than this may not
    have finished yet, so the forecast's series ends that long ago."""
    took = sorted(max(r.stages.values(), default=r.arrival) - r.arrival for r in records)
    return max(0.0, took[int(0.9 * (len(took) - 1))]) if took else 0.0


def forecast_load(
    records: Sequence[TraceRecord], config: ForecastConfig, now: float | None = None
) -> Forecast:
    now = time.time() if now is None else now
    return forecast([r.arrival for r in records], now, config, lag_s=finish_lag(records))


def moved(previous: CapacityDecision | None, latest: Forecast, threshold: float) -> bool:
    """Whether the forecast rate moved by more than `threshold` of the last sizing's."""
    if previous is None:
        return True
    before = previous.forecast.rate
    return abs(latest.rate - before) > threshold * max(before, MIN_RATE)
