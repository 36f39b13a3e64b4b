"""Holt's linear trend on the recorded arrivals: the rate the planner sizes capacity for."""

from __future__ import annotations

import random

import pytest

from common.planner.forecast import ForecastConfig, arrival_series, forecast, holt

CONFIG = ForecastConfig(bin_s=10.0, window_s=300.0, horizon_s=60.0)


def poisson(rate_at, start: float, end: float, seed: int = 1) -> list[float]:
    """Arrival times of a Poisson process whose rate changes with time (thinning)."""
    rng, top = random.Random(seed), max(rate_at(t / 10) for t in range(int(start * 10), int(end * 10)))
    out, t = [], start
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() < rate_at(t) / top:
            out.append(t)


def test_holt_follows_a_line_exactly() -> None:
    level, trend = holt([1.0, 2.0, 3.0, 4.0, 5.0], 0.5, 0.3)
    assert level == pytest.approx(5.0) and trend == pytest.approx(1.0)


def test_series_counts_whole_bins_back_from_the_end() -> None:
    series = arrival_series([0.0, 1.5, 12.0, 25.0, 29.9, 31.0], end=30.0, bin_s=10.0, window_s=300.0)
    assert series == [pytest.approx(0.2), pytest.approx(0.1), pytest.approx(0.2)]  # 31.0 is after the end
    # A bin that began before the first arrival would read as a lull: it is left out.
    assert arrival_series([0.5, 12.0], end=30.0, bin_s=10.0, window_s=300.0) == [0.1, 0.0]
    assert arrival_series([25.0], end=30.0, bin_s=10.0, window_s=300.0) == []  # no whole bin yet
    assert len(arrival_series([0.0], end=1000.0, bin_s=10.0, window_s=300.0)) == 30  # the window bounds it


def test_a_steady_load_forecasts_its_rate() -> None:
    arrivals = poisson(lambda t: 4.0, 0.0, 300.0)
    f = forecast(arrivals, now=300.0, config=CONFIG)
    assert f.points == 29  # the first arrival is after 0 s: the oldest bin is not whole
    assert f.level == pytest.approx(4.0, rel=0.3) and f.rate == pytest.approx(4.0, rel=0.35)


def test_a_rising_load_is_planned_for_ahead_and_a_falling_one_is_kept_until_it_has_fallen() -> None:
    rising = poisson(lambda t: 1.0 + t / 30.0, 0.0, 300.0, seed=2)  # 1 → 11 req/s
    up = forecast(rising, now=300.0, config=CONFIG)
    assert up.trend > 0 and up.at_horizon > up.level and up.rate == up.at_horizon
    assert up.rate > 11.0  # a minute past the last rate seen
    falling = poisson(lambda t: 11.0 - t / 30.0, 0.0, 300.0, seed=3)
    down = forecast(falling, now=300.0, config=CONFIG)
    assert down.trend < 0 and down.rate == down.level  # not sized down ahead of the load
    assert down.at_horizon >= 0.0


def test_a_load_that_stopped_forecasts_nothing_and_lag_holds_back_unfinished_bins() -> None:
    arrivals = poisson(lambda t: 5.0, 0.0, 200.0, seed=4)
    stopped = forecast(arrivals, now=500.0, config=CONFIG)
    assert stopped.level < 0.5 and stopped.rate < 0.5
    # Requests still running are missing from the newest bins: with the lag they are not read as a drop.
    recorded = [t for t in arrivals if t < 190.0]  # those after 190 s have not finished yet
    assert forecast(recorded, now=200.0, config=CONFIG, lag_s=10.0).level == pytest.approx(5.0, rel=0.3)
    assert forecast(recorded, now=200.0, config=CONFIG).level < 4.0


def test_little_history_uses_the_mean_rate_and_bad_settings_are_refused() -> None:
    assert forecast([], now=10.0, config=CONFIG).rate == 0.0
    f = forecast([1.0, 2.0, 3.0, 4.0], now=5.0, config=CONFIG)
    assert f.points == 0 and f.rate == pytest.approx(0.4)  # 4 over one bin's width at least
    for bad in ({"bin_s": 0}, {"window_s": 5.0}, {"alpha": 0}, {"beta": 1.5}, {"horizon_s": -1}):
        with pytest.raises(ValueError):
            ForecastConfig(**bad)
