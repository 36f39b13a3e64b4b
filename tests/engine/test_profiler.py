"""The budget profiler finds the right budgets on a synthetic latency model, and on the real engine."""

from __future__ import annotations

import math

from common.engine.config import Role
from common.engine.profiler import BudgetProfiler, StageProfile, latency_limit, search_budget


def test_latency_limit_by_role_set():
    ep = frozenset({Role.ENCODE, Role.PREFILL})
    assert latency_limit(ep, ttft_slo=2.0, tbt_slo=0.1) == 1.0  # α = 0.5 of TTFT
    assert latency_limit(frozenset({Role.PREFILL}), 2.0, 0.1) == 1.0
    assert latency_limit(frozenset({Role.ENCODE, Role.DECODE}), 2.0, 0.1) == 0.1
    assert latency_limit(frozenset(Role), 2.0, 0.1) == 0.1


def test_search_finds_the_largest_budget_under_the_limit():
    calls = []

    def linear(n: int) -> float:  # 5 ms fixed + 1 ms a token
        calls.append(n)
        return 0.005 + 0.001 * n

    assert search_budget(linear, limit=0.5, hi=8192) == 495
    assert len(calls) <= math.ceil(math.log2(8192)) + 1
    assert search_budget(lambda n: 0.03 * n**0.5, limit=0.3, hi=1000) == 100
    assert search_budget(lambda n: 1.0, limit=0.1, hi=64) == 1  # never zero: the instance must progress


def test_profile_of_the_tiny_engine_round_trips(make_engine):
    engine = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    profile = BudgetProfiler(engine, repeats=1).profile(
        ttft_slo=10.0, tbt_slo=1.0, max_images=4, max_tokens=64
    )
    # A generous SLO admits the whole search range.
    assert (profile.image_budget, profile.token_budget) == (4, 64)
    assert profile.roles == ["encode", "prefill"] and profile.latency_limit == 5.0
    assert profile.encode and profile.prefill and profile.decode
    assert StageProfile.from_json(profile.to_json()) == profile
    engine.apply_profile(profile)
    assert engine.scheduler.token_budget == 64 and engine.blocks.num_free == engine.blocks.num_blocks
