"""Capacity: the fewest instances of each kind that serve a rate, within per-kind bounds and a budget,
and never below what queued work needs (common/planner/capacity.py)."""

from __future__ import annotations

import pytest

from common.planner.algorithm import plan
from common.planner.capacity import recommend
from common.planner.limits import KINDS, Limits, parse_counts
from common.planner.paper_profiles import paper_profiles
from common.planner.workloads import generate
from common.roles import Role
from common.stats import SLO

PROFILES = paper_profiles("llava-1.5-7b")
TRACE = generate("textcaps", rate=5, num_requests=80, seed=7)
SLO_ = SLO(ttft=4, tbt=0.08)


def test_the_fewest_instances_that_serve_the_rate() -> None:
    c = recommend(TRACE, PROFILES, SLO_, 60.0, Limits())
    n = c.deployment.instances
    assert c.short is None and c.goodput >= 60.0
    assert set(c.desired) == set(KINDS) and sum(c.desired.values()) == n
    # One instance fewer, split the best way, does not serve it.
    assert plan(TRACE, PROFILES, SLO_, n - 1).goodput < 60.0
    assert c.to_dict()["desired"] == c.desired and c.cost == n


def test_a_budget_caps_the_recommendation_and_says_it_falls_short() -> None:
    c = recommend(TRACE, PROFILES, SLO_, 60.0, Limits(budget=4.0))
    assert c.deployment.instances == 4 and c.cost <= 4.0
    assert c.short is not None and "budget of 4 cores" in c.short and c.goodput < 60.0
    # Costlier instances: a budget of 8 runs four that take 2 cores each.
    c = recommend(TRACE, PROFILES, SLO_, 60.0, Limits(budget=8.0, cost=2.0))
    assert c.deployment.instances == 4 and c.cost == 8.0


def test_per_kind_bounds_hold() -> None:
    free = recommend(TRACE, PROFILES, SLO_, 30.0, Limits())
    kind, n = max(free.deployment.replicas, key=lambda r: r[1])
    bounded = recommend(TRACE, PROFILES, SLO_, 30.0, Limits(maximum={kind: n - 1}))
    assert bounded.desired[kind] <= n - 1 and bounded.goodput >= 30.0
    kept = recommend(TRACE, PROFILES, SLO_, 30.0, Limits(minimum={k: 2 for k in KINDS}))
    assert all(count >= 2 for count in kept.deployment.counts.values())


def test_queued_work_keeps_the_instances_that_run_its_stage() -> None:
    c = recommend(TRACE, PROFILES, SLO_, 30.0, Limits())
    runs_prefill = sum(n for k, n in c.desired.items() if "p" in k)
    running = {"p": runs_prefill + 2}
    held = recommend(TRACE, PROFILES, SLO_, 30.0, Limits(), queued={Role.PREFILL: 7}, running=running)
    assert sum(n for k, n in held.desired.items() if "p" in k) == runs_prefill + 2
    assert sum(held.held.values()) == 2
    idle = recommend(TRACE, PROFILES, SLO_, 30.0, Limits(), queued={Role.PREFILL: 0}, running=running)
    assert idle.desired == c.desired and idle.held == {}
    # The floor stays within the limits.
    capped = recommend(TRACE, PROFILES, SLO_, 30.0, Limits(budget=c.cost + 1), queued={Role.PREFILL: 7},
                       running=running)  # fmt: skip
    assert capped.cost <= c.cost + 1


def test_limits_and_counts_are_checked() -> None:
    assert parse_counts(" e=1, D=2 ,", "min") == {"e": 1, "d": 2}
    for bad in ("x=1", "e", "e=two", "e=-1"):
        with pytest.raises(ValueError, match="min"):
            parse_counts(bad, "min")
    with pytest.raises(ValueError, match="above its maximum"):
        Limits(minimum={"d": 3}, maximum={"d": 2})
    with pytest.raises(ValueError, match="budget"):
        Limits(budget=0)
    assert Limits(budget=5.0).instance_range() == (2, 5)  # two: EP+D or ED+P
    assert Limits(maximum={"e": 1, "p": 1, "d": 1, "ep": 1, "ed": 1}).instance_range() == (2, 3)
