"""What load to plan capacity for: the arrival rate over the planner's horizon, forecast with Holt's
linear trend (double exponential smoothing) on the arrivals the trace recorded.

    series:  arrivals counted in bins of `bin_s` seconds, back from the newest settled moment over
             at most `window_s` seconds (requests per second in each bin)
    Holt:    level ← α·x + (1 − α)·(level + trend);  trend ← β·(level − level′) + (1 − β)·trend
    plan for max(level, level + trend · horizon_s / bin_s), never below 0

The trace holds finished requests only, so the newest bins would be short of requests that have
arrived and not yet finished: the series ends `lag_s` before now (the planner passes the p90 of how
long its requests took). Planning for the larger of the present rate and the forecast adds
capacity ahead of a rising load and keeps it until the load has fallen, not before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ForecastConfig:
    bin_s: float = 10.0  # width of one point of the series
    window_s: float = 300.0  # most history fitted
    horizon_s: float = 60.0  # how far ahead capacity is planned for
    alpha: float = 0.5  # level smoothing
    beta: float = 0.3  # trend smoothing

    def __post_init__(self) -> None:
        if not (self.bin_s > 0 and self.window_s >= self.bin_s and self.horizon_s >= 0):
            raise ValueError("forecast: need bin_s > 0, window_s ≥ bin_s and horizon_s ≥ 0")
        if not (0 < self.alpha <= 1 and 0 < self.beta <= 1):
            raise ValueError("forecast: alpha and beta must lie in (0, 1]")


@dataclass(frozen=True)
class Forecast:
    rate: float  # requests/s to plan for: max(level, at_horizon)
    level: float  # the smoothed present rate
    trend: float  # change of the rate per second
    at_horizon: float  # the rate forecast `horizon_s` ahead
    points: int  # bins fitted
    horizon_s: float

    def to_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def holt(series: Sequence[float], alpha: float, beta: float) -> tuple[float, float]:
    """Level and trend (per point) after smoothing `series`; a single point has no trend."""
    if not series:
        raise ValueError("holt: an empty series has no level")
    level, trend = series[0], (series[1] - series[0]) if len(series) > 1 else 0.0
    for x in series[1:]:
        previous = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - previous) + (1 - beta) * trend
    return level, trend


def arrival_series(arrivals: Sequence[float], end: float, bin_s: float, window_s: float) -> list[float]:
    """Requests per second in consecutive bins ending at `end`, oldest first, covering at most
    `window_s` and only whole bins after the first arrival (a bin before it would read as a lull)."""
    if not arrivals:
        return []
    first = min(arrivals)
    bins = min(int(window_s // bin_s), int(max(0.0, end - first) // bin_s))
    if bins == 0:
        return []
    start = end - bins * bin_s
    counts = [0] * bins
    for t in arrivals:
        if start <= t < end:
            counts[int((t - start) // bin_s)] += 1
    return [c / bin_s for c in counts]


def forecast(arrivals: Sequence[float], now: float, config: ForecastConfig, lag_s: float = 0.0) -> Forecast:
    """The rate to plan for, from absolute arrival times (seconds) of the recorded requests.

    With under two whole bins of history the mean rate over what there is stands for the level."""
    c = config
    series = arrival_series(arrivals, now - max(0.0, lag_s), c.bin_s, c.window_s)
    if len(series) < 2:
        span = max(now - lag_s - min(arrivals), c.bin_s) if arrivals else 0.0
        level = len(arrivals) / span if arrivals else 0.0
        return Forecast(level, level, 0.0, level, len(series), c.horizon_s)
    level, trend = holt(series, c.alpha, c.beta)
    level = max(0.0, level)
    ahead = max(0.0, level + trend * c.horizon_s / c.bin_s)
    return Forecast(max(level, ahead), level, trend / c.bin_s, ahead, len(series), c.horizon_s)
