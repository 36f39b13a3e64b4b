"""The planner fits its stage curves to the steps instances ran in service (StepStats)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.planner.calibrate import (
    SERVICE_MIN_STEPS,
    _shape,
    calibrate_from_service,
    fit_host_effects,
    service_factors,
)
from common.planner.profiles import ProfileSet, TransferModel
from common.planner.simulator import simulate
from common.planner.trace import TraceEntry
from common.planner.types import Deployment
from common.protocol import StepStats
from common.protocol.records import Step
from common.stats import SLO
from tests.helpers.planning import CURVES

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


def test_what_sharing_the_cores_added_to_the_steps_is_not_counted_twice():
    """Two EP instances and a D on one core, text requests: the steps they ran in service took
    their true time (TRUE) stretched by the others' steps beside them, as much as a replay of the
    same requests at the true factors says. The simulator shares the core out itself, so the
    calibration takes that stretch out: the factors come back near the true ones, where the steps
    alone say the stretch more. Prefill within 10 %; decode within 20 %, as a decoder's overlap
    with the prefills jumps with small changes in when steps start (1.06 or 1.22 here)."""
    shared = dataclasses.replace(PROFILES, host_cores=1)
    deployment = Deployment.of("ep+d", ep=2, d=1)
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(1.0, 60))
    trace = [
        TraceEntry(float(t), int(rng.integers(20, 300)), 0, 0, int(rng.integers(4, 20))) for t in arrivals
    ]
    true = service_factors(served(np.random.default_rng(2), sigma=0.0), PROFILES).apply(shared)
    stretch = simulate(trace, deployment, true, SLO(ttft=30, tbt=5)).sharing
    assert stretch["prefill"] > 1.3  # the instances did overlap

    def stretched(record: StepStats) -> StepStats:
        # Without threads and overlap (an older record's six fields): the stretch is not known.
        steps = tuple(Step(*step[:5], step.seconds * stretch.get(step.kind, 1.0)) for step in record.steps)
        return record.model_copy(update={"steps": steps})

    records = [stretched(r) for r in served(np.random.default_rng(2), sigma=0.0)]
    naive = service_factors(records, PROFILES)
    assert naive.factors["prefill"] == pytest.approx(TRUE["prefill"] * stretch["prefill"], rel=0.01)
    calibration = calibrate_from_service(records, shared, trace, deployment, SLO(ttft=30, tbt=5))
    assert calibration.factors["prefill"] == pytest.approx(TRUE["prefill"], rel=0.1)
    assert calibration.factors["decode"] == pytest.approx(TRUE["decode"], rel=0.2)
    assert calibration.sharing["prefill"] == pytest.approx(stretch["prefill"], rel=0.1)
    assert calibrate_from_service(records, PROFILES, trace, deployment).sharing == {}  # own devices


def host_steps(rng, kind: str, exponent: float, interference: float, n: int = 80) -> list[tuple]:
    """Steps of a greedy worker on one thread (its share, as profiled) or two (the cores the others
    left), beside 0–2 other workers' steps (one thread each) on two cores: time ∝ threads^-exponent
    × e^(interference·overlap), and stretched while the threads outnumber the cores."""
    steps = []
    for _ in range(n):
        tokens, decodes = int(rng.integers(10, 900)), int(rng.integers(1, 30))
        threads, overlap = int(rng.integers(1, 3)), float(rng.choice([0.0, 0.5, 1.0, 2.0]))
        if kind == "prefill":
            shape, predicted = (0.0, tokens, 0, 0.0), CURVES.prefill_time(tokens)
        else:
            shape, predicted = (0.0, 0, decodes, 200.0), CURVES.iteration_time(0.0, 0, decodes, 200.0)
        shared = max(1.0, (threads + overlap) / 2)
        seconds = predicted * TRUE[kind] * threads**-exponent * np.exp(interference * overlap) * shared
        steps.append((kind, *shape, seconds * float(np.exp(0.05 * rng.standard_normal())), threads, overlap))
    return steps


def test_steps_say_how_threads_changed_them_and_are_fitted_without_them():
    """Steps that say their threads and how many other steps ran beside them: the exponent (0.6)
    comes back, and the stage factors are those of a step on the profiled thread with its own
    share of the cores, where the steps averaged would say otherwise."""
    rng = np.random.default_rng(5)
    records = [
        stats("p-1", ("prefill",), host_steps(rng, "prefill", 0.6, 0.0)),
        stats("d-1", ("decode",), host_steps(rng, "decode", 0.6, 0.0)),
    ]
    profiled_on_one = dataclasses.replace(PROFILES, threads=1, host_cores=2)
    calibration = service_factors(records, profiled_on_one)
    assert calibration.thread_exponent == pytest.approx({"prefill": 0.6, "decode": 0.6}, abs=0.05)
    assert calibration.interference == {}  # not applied in service (`service_factors`)
    for stage in ("prefill", "decode"):
        assert calibration.factors[stage] == pytest.approx(TRUE[stage], rel=0.05), stage
    assert calibration.jitter == pytest.approx(0.05, abs=0.02)  # threads and neighbours are not noise
    # Each step said its own share of the cores: a replay's stretch is neither needed nor taken.
    trace = [TraceEntry(float(t), 100, 0, 0, 8, tbt_p90=0.05) for t in range(12)]
    served_on_board = calibrate_from_service(
        records, profiled_on_one, trace, Deployment.of("ep+d", ep=1, d=1), SLO(ttft=30, tbt=5)
    )
    assert served_on_board.sharing == {}
    assert served_on_board.factors == calibration.factors
    applied = calibration.apply(profiled_on_one)
    assert applied.thread_exponent == calibration.thread_exponent
    assert applied.interference == calibration.interference
    # Without the profile's threads, or the steps' own, there is nothing to relate them to.
    for unknown in (
        service_factors(records, PROFILES),
        service_factors([_old(r) for r in records], profiled_on_one),
    ):
        assert unknown.thread_exponent == unknown.interference == {}
        assert unknown.jitter > 2 * calibration.jitter  # the threads taken for noise
        assert unknown.apply(profiled_on_one).thread_exponent == {}


def _old(record: StepStats) -> StepStats:
    """As a worker published it before steps said their threads and neighbours."""
    return record.model_copy(update={"steps": tuple(Step(*step[:6]) for step in record.steps)})


def test_the_thread_exponent_is_fitted_with_the_neighbours_held_fixed():
    """`fit_host_effects` on steps slowed by their neighbours too (λ: prefill 0.2, decode 0.4),
    varying in threads and neighbours apart: the exponent comes back, beside each kind's λ, which
    the service calibration then leaves out (`service_factors`)."""
    rng = np.random.default_rng(5)
    steps = []
    for kind, lam in (("prefill", 0.2), ("decode", 0.4)):
        for step in host_steps(rng, kind, 0.6, lam):
            _, images, tokens, decodes, context, seconds, threads, overlap = step
            own = seconds / max(1.0, (threads + overlap) / 2)
            predicted = CURVES.iteration_time(images, tokens, decodes, context) * TRUE[kind]
            shape = _shape(kind, images, tokens, decodes)
            steps.append((kind, shape, float(np.log(own / predicted)), float(threads), overlap))
    exponents, lambdas = fit_host_effects(steps)
    assert exponents == pytest.approx({"prefill": 0.6, "decode": 0.6}, abs=0.05)
    assert lambdas == pytest.approx({"prefill": 0.2, "decode": 0.4}, abs=0.05)
