"""The latency an iteration may take and the budget that fits it (000 Algorithm 1, line 5): the
arithmetic the budget profiler (profiler.py) measures against and the planner's simulator replays,
apart from the engine, so that the planner reads it without importing torch."""

from __future__ import annotations

from collections.abc import Callable

from common.roles import Role

ALPHA = 0.5
# Budgets are searched against this share of the latency limit. The profile keeps the least time
# of its repeats, a full iteration in service runs a few percent slower, and a client sees each
# gap plus the token's delivery: on small-llava EPD (TBT limit 200 ms), prefill+decode iterations
# sized to the whole limit ran 199 ms p50 and 208 ms p90, over it half the time.
BUDGET_SHARE = 0.9


def latency_limit(roles: frozenset[Role], ttft_slo: float, tbt_slo: float, alpha: float = ALPHA) -> float:
    """The per-iteration latency cap for an instance with these roles."""
    return tbt_slo if Role.DECODE in roles else alpha * ttft_slo


def budget_target(limit: float) -> float:
    """The latency a full iteration is sized to: the limit, less a margin for noise."""
    return BUDGET_SHARE * limit


def search_budget(
    measure: Callable[[int], float], limit: float, hi: int, lo: int = 1, resolution: int = 1
) -> int:
    """Largest n in [lo, hi] with measure(n) <= limit, to within `resolution`, assuming latency
    grows with n; `lo` is taken to be within the limit (known, or the least acceptable).

    Returns `lo` (1 by default) when nothing larger is under the limit: an instance that could do
    nothing would hang its requests, so it runs minimal batches and the SLO miss shows in the
    measurements instead.
    """
    best = lo  # invariant: best is within the limit, everything above hi is over it
    while hi - best >= resolution:
        mid = (best + 1 + hi) // 2
        if measure(mid) <= limit:
            best = mid
        else:
            hi = mid - 1
    return best
