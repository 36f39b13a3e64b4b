"""What the planner publishes for an autoscaler when its recommendation changes the method: a live
kind it drops is kept until live instances of the kinds it keeps run that kind's stages (make before
break), then published at 0; before the first sizing, the starting method and whatever runs."""

from __future__ import annotations

from common.planner.handover import KINDS, hand_over, standing


def counts(**n: int) -> dict[str, int]:
    return {k: n.get(k, 0) for k in KINDS}


def test_a_dropped_kind_is_kept_until_the_kinds_kept_run_its_stages_live() -> None:
    wanted = counts(e=1, p=2, d=1)
    # EP+D runs; E+P+D asked for: the EP instances stay while no encoder or prefill instance is live.
    assert hand_over(wanted, {"ep": 3, "d": 1}) == counts(e=1, p=2, d=1, ep=3)
    assert hand_over(wanted, {"ep": 3, "d": 1, "e": 1}) == counts(e=1, p=2, d=1, ep=3)  # no prefill yet
    assert hand_over(wanted, {"ep": 3, "d": 1, "e": 1, "p": 1}) == wanted  # now they do: EP goes
    # Kept within its maximum, but never below one, even under a cap of 0 (the cap retires it after).
    assert hand_over(wanted, {"ep": 3, "d": 1}, {"ep": 2}) == counts(e=1, p=2, d=1, ep=2)
    assert hand_over(wanted, {"ep": 3, "d": 1}, {"ep": 0}) == counts(e=1, p=2, d=1, ep=1)
    # A live instance of a kind the recommendation also drops covers nothing.
    assert hand_over(counts(ed=1, p=1), {"ep": 1, "d": 1}) == counts(ed=1, p=1, ep=1, d=1)
    # Nothing runs that is dropped: the recommendation as it is.
    assert hand_over(wanted, {}) == wanted


def test_before_the_first_sizing_the_starting_method_and_what_runs() -> None:
    assert standing({}, {}) is None  # nothing known: no count at all (KEDA keeps what runs)
    assert standing({}, {"ep": 1, "d": 1}) == counts(ep=1, d=1)
    assert standing({"ep": 1}, {"ep": 1, "d": 1}) == counts(ep=1, d=1)  # d still starting: kept
    assert standing({"e": 2, "p": 1, "d": 1}, {"ep": 1, "d": 1}) == counts(e=2, p=1, d=1, ep=1)
