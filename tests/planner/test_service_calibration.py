"""The planner fits its stage curves to the steps instances ran in service (StepStats)."""

from __future__ import annotations

import numpy as np
import pytest

from common.planner.calibrate import SERVICE_MIN_STEPS, service_factors
from common.planner.profiles import ProfileSet, TransferModel
from common.protocol import StepStats
from tests.planner.test_simulator import CURVES

PROFILES = ProfileSet(CURVES, TransferModel())
TRUE = {"encode": 2.0, "prefill": 1.5, "decode": 1.2}


def stats(instance: str, roles: tuple[str, ...], steps: list[tuple]) -> StepStats:
    return StepStats(instance_id=instance, roles=roles, time=0.0, image_budget=3, token_budget=90,
                     budget_scale=0.6, steps=tuple(steps))  # fmt: skip


def served(rng, sigma: float = 0.1, mixed: int = 0) -> list[StepStats]:
    """Steps of an E, a P and a D instance as the true factors (and log-normal noise) make them."""

    def step(kind, images=0.0, tokens=0, decodes=0, context=0.0):
        predicted = CURVES.iteration_time(images, tokens, decodes, context)
        factor = TRUE.get(kind, 1.4)
        return (
            kind,
            images,
            tokens,
            decodes,
            context,
            predicted * factor * float(np.exp(sigma * rng.standard_normal())),
        )

    e = [step("encode", images=float(rng.integers(1, 4))) for _ in range(60)]
    p = [step("prefill", tokens=int(rng.integers(10, 900))) for _ in range(60)]
    d = [
        step("decode", decodes=int(rng.integers(1, 30)), context=float(rng.integers(50, 500)))
        for _ in range(60)
    ]
    m = [step("mixed", tokens=200, decodes=4, context=300.0) for _ in range(mixed)]
    return [stats("e-1", ("encode",), e), stats("p-1", ("prefill",), p), stats("d-1", ("decode",), d + m)]


def test_each_stage_factor_is_what_its_steps_took_over_the_curve():
    calibration = service_factors(served(np.random.default_rng(0)), PROFILES)
    for stage, factor in TRUE.items():
        assert calibration.factors[stage] == pytest.approx(factor, rel=0.05), stage
    assert calibration.jitter == pytest.approx(0.1, abs=0.03)
    assert calibration.steps["encode"] == calibration.steps["decode"] == 60
    assert calibration.budgets["p-1"] == {"image_budget": 3, "token_budget": 90, "scale": 0.6}
    scaled = calibration.apply(PROFILES)
    assert scaled.curves.prefill_time(500) == pytest.approx(1.5 * CURVES.prefill_time(500), rel=0.05)
    assert scaled.jitter == calibration.jitter


def test_a_stage_without_pure_steps_takes_the_mixed_steps_factor_and_none_leaves_the_curve():
    records = served(np.random.default_rng(1), sigma=0.0, mixed=SERVICE_MIN_STEPS)
    only_decode = [records[2]]  # a D instance: no encode or prefill steps of its own
    calibration = service_factors(only_decode, PROFILES)
    assert calibration.factors["decode"] == pytest.approx(TRUE["decode"], rel=0.01)
    assert calibration.factors["prefill"] == calibration.factors["encode"] == pytest.approx(1.4, rel=0.01)
    assert service_factors([], PROFILES).factors == {}
    assert service_factors([], PROFILES).apply(PROFILES).curves == PROFILES.curves
