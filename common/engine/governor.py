"""Budgets that follow the machine as it runs, not only as it was profiled at start-up.

The profiler sizes τe and τt so that a full step takes the budget target (90 % of the latency
limit). In service a step can run slower than its profile: other processes on the same cores
(the gateway, a client, the broker), a GPU shared with another tenant, thermal limits. Then every
full step overshoots the limit — on small-llava EPD on two shared cores, steps sized to 180 ms ran
~230 ms, and each became a gap over the 200 ms TBT (docs/benchmarks.md, "Ablations").

The governor watches steps that fill most of their budgets, estimates what a full step takes now
(seconds / share of the budgets used, a step's cost being close to linear in its tokens and
images), and every WINDOW such steps scales both budgets so that a full step meets the target
again: down when the upper quartile of full steps is over it, back up (never past the profile)
when it is well under. The upper quartile, not the median: a step over the limit is a gap over
the TBT, and in service step times spread (holding the median to the target, small-llava EPD
reached 1.4 req/s where a budget capped by hand reached 1.8). Steps that are mostly empty (a few
decodes) say nothing about a full one and are ignored.
"""

from __future__ import annotations

from common.stats import quantile

WINDOW = 8  # full steps per decision
QUANTILE = 0.75  # of a window's full steps, the one held to the target
FULL = 0.75  # a step using at least this share of its budgets counts as full
GROW_BELOW = 0.9  # grow only when a full step takes under this share of the target (hysteresis)
FLOOR = 0.25  # budgets never fall below this share of the profiled ones


def budget_share(batch, image_budget: int, token_budget: int, image_unit: int | None) -> float:
    """The share of its budgets a batch used: images/τe + tokens/τt, τe counted as the scheduler
    counts it (Scheduler.image_unit). What `BudgetGovernor.observe` takes, in the engine and in the
    planner's simulated instances alike."""
    images = batch.image_cost(image_unit) / (image_unit or 1)
    return images / max(1, image_budget) + batch.num_tokens / max(1, token_budget)


class BudgetGovernor:
    def __init__(self, image_budget: int, token_budget: int, target: float) -> None:
        self.profiled = (image_budget, token_budget)
        self.target = target
        self.scale = 1.0
        self.last_ratio = 1.0  # the last window's upper-quartile full step, as a multiple of the target
        self._ratios: list[float] = []

    @property
    def budgets(self) -> tuple[int, int]:
        """(τe, τt) in force: the profiled ones times the current scale, at least 1 each."""
        images, tokens = self.profiled
        return max(1, int(images * self.scale)), max(1, int(tokens * self.scale))

    def observe(self, share: float, seconds: float) -> bool:
        """One step that used `share` of its budgets (images/τe + tokens/τt) and took `seconds`;
        True when the budgets changed."""
        if share < FULL:
            return False
        self._ratios.append(seconds / share / self.target)
        if len(self._ratios) < WINDOW:
            return False
        ratio = self.last_ratio = quantile(self._ratios, QUANTILE)
        self._ratios.clear()
        if GROW_BELOW <= ratio <= 1.0:
            return False
        scale = min(1.0, max(FLOOR, self.scale / ratio))
        before, self.scale = self.budgets, scale
        return self.budgets != before
