"""The budget governor: full steps that run slow shrink the budgets until a full step meets the
target again; fast ones grow them back, never past the profile; mostly empty steps say nothing."""

from __future__ import annotations

from common.engine.governor import FLOOR, WINDOW, BudgetGovernor


def run(governor: BudgetGovernor, slowdown: float, steps: int) -> None:
    """Full steps on a machine `slowdown` times slower than profiled (a full step at the profiled
    budgets takes the target; cost is linear in the budgets used)."""
    for _ in range(steps):
        tokens = governor.budgets[1]
        governor.observe(1.0, slowdown * governor.target * tokens / governor.profiled[1])


def test_slow_full_steps_shrink_the_budgets_to_meet_the_target():
    g = BudgetGovernor(image_budget=8, token_budget=184, target=0.18)
    run(g, slowdown=1.3, steps=WINDOW - 1)
    assert g.budgets == (8, 184), "no decision before a window of full steps"
    run(g, slowdown=1.3, steps=1)
    images, tokens = g.budgets
    assert tokens == int(184 / 1.3) and images == int(8 / 1.3)
    run(g, slowdown=1.3, steps=4 * WINDOW)
    assert g.budgets == (images, tokens), "settled: a full step now takes the target"


def test_budgets_grow_back_when_the_machine_is_fast_again_but_never_past_the_profile():
    g = BudgetGovernor(image_budget=4, token_budget=100, target=0.18)
    run(g, slowdown=2.0, steps=WINDOW)
    assert g.budgets == (2, 50)
    run(g, slowdown=1.0, steps=WINDOW)
    assert g.budgets == (4, 100)
    run(g, slowdown=0.5, steps=3 * WINDOW)
    assert g.budgets == (4, 100)


def test_a_machine_far_slower_stops_at_the_floor_and_empty_steps_are_ignored():
    g = BudgetGovernor(image_budget=4, token_budget=100, target=0.18)
    for _ in range(3 * WINDOW):
        assert not g.observe(0.1, 10.0), "a mostly empty step says nothing about a full one"
    assert g.budgets == (4, 100)
    run(g, slowdown=100.0, steps=WINDOW)
    assert g.budgets == (max(1, int(4 * FLOOR)), int(100 * FLOOR))


def test_an_engine_adapts_only_after_a_profile_and_only_when_asked(make_engine):
    from common.engine.profiler import StageProfile

    profile = StageProfile(["decode", "encode", "prefill"], 0.2, image_budget=4, token_budget=64)
    engine = make_engine(adapt_budgets=False)
    engine.apply_profile(profile)
    assert engine.governor is None
    engine = make_engine()
    assert engine.governor is None
    engine.apply_profile(profile)
    assert engine.governor.budgets == (4, 64) and engine.governor.target == 0.9 * 0.2
    engine.governor.scale = 0.5  # as if steps had run twice as slow
    engine.governor._ratios = [2.0] * (WINDOW - 1)
    engine.scheduler.token_budget, engine.scheduler.image_budget = 32, 2
    prompt = engine.chat_prompt("hello " * 40)
    engine.add_request(prompt)
    engine.step()  # a step that fills τt completes the window; its upper-quartile full step is 2x the target
    assert (engine.scheduler.image_budget, engine.scheduler.token_budget) == (1, 16)
