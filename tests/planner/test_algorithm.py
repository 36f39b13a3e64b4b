"""Algorithm 2: the partition, the candidate sets, the goodput search, and the pick against brute force."""

from __future__ import annotations

import pytest

from common.planner.algorithm import (
    NoSplit,
    StageCosts,
    Workload,
    every_split,
    goodput,
    neighbourhood,
    partition,
    plan,
    stage_costs,
    throughput_bound,
)
from common.planner.paper_profiles import paper_profiles
from common.planner.types import Deployment
from common.planner.workloads import generate
from common.stats import SLO

PROFILES = paper_profiles("llava-1.5-7b")


def test_partition_follows_stage_times_with_one_each_at_least() -> None:
    assert partition(8, StageCosts(1.0, 2.0, 5.0)) == (1, 2, 5)
    assert partition(3, StageCosts(0.0, 0.0, 9.0)) == (1, 1, 1)
    assert sum(partition(32, StageCosts(0.3, 1.1, 2.9))) == 32
    with pytest.raises(ValueError):
        partition(2, StageCosts(1, 1, 1))


def test_every_split_counts_as_in_the_paper() -> None:
    # 000 §4.4: 2·C(N-1, 1) + C(N-1, 2) deployments; 35 for N = 8.
    splits = every_split(8)
    assert len(splits) == 35 == len({d.label for d in splits})
    assert all(d.instances == 8 for d in splits)


def test_neighbourhood_is_the_partition_and_one_move_away() -> None:
    labels = {d.label for d in neighbourhood(8, (2, 3, 3))}
    assert {"2E3P3D", "3E2P3D", "1E3P4D", "5EP3D", "4EP4D", "6EP2D", "5ED3P", "4ED4P", "6ED2P"} <= labels
    assert all(d.instances == 8 for d in neighbourhood(8, (2, 3, 3)))


def test_throughput_bound_is_the_slowest_stage() -> None:
    costs = StageCosts(encode=0.1, prefill=0.2, decode=0.4)
    assert throughput_bound(Deployment.of("e+p+d", e=1, p=1, d=2), costs) == pytest.approx(5.0)
    assert throughput_bound(Deployment.of("ep+d", ep=3, d=2), costs) == pytest.approx(5.0)


def test_goodput_never_exceeds_the_bound_and_meets_the_slo_there() -> None:
    trace = generate("pope", rate=5, num_requests=120, seed=3)
    slo = SLO(ttft=4, tbt=0.08)
    dep = Deployment.of("e+p+d", e=1, p=2, d=1)
    bound = throughput_bound(dep, stage_costs(Workload.of(trace), PROFILES.curves, slo))
    score = goodput(trace, dep, PROFILES, slo)
    assert score.bound == round(bound, 4)  # scores are reported to 4 decimals
    assert 0 < score.goodput <= score.bound
    assert score.attainment >= 0.9


def _brute_force(trace, slo: SLO, instances: int):
    """Every split simulated with no pruning, the best by the planner's own ordering."""
    scores = [goodput(trace, d, PROFILES, slo) for d in every_split(instances)]
    return max(scores, key=lambda s: (s.goodput, -(s.ttft_p90 or 0.0)))


@pytest.mark.parametrize(
    ("shape", "slo"),
    [("textcaps", SLO(ttft=4, tbt=0.08)), ("mme", SLO(ttft=0.6, tbt=0.08)), ("mix", SLO(ttft=2, tbt=0.04))],
)
def test_the_pick_equals_brute_force_over_every_split(shape: str, slo: SLO) -> None:
    trace = generate(shape, rate=5, num_requests=80, seed=7)
    best = _brute_force(trace, slo, 5)
    result = plan(trace, PROFILES, slo, 5)
    assert result.goodput == pytest.approx(best.goodput)
    assert result.deployment.label == best.deployment.label or result.goodput == best.goodput
    heuristic = plan(trace, PROFILES, slo, 5, exhaustive=False)
    assert heuristic.goodput == pytest.approx(best.goodput, rel=0.05)


def test_the_plan_says_how_close_the_runner_up_was() -> None:
    trace = generate("textcaps", rate=5, num_requests=80, seed=7)
    result = plan(trace, PROFILES, SLO(ttft=4, tbt=0.08), 5)
    runner = result.runner_up
    simulated = sorted((c.goodput for c in result.candidates if not c.pruned), reverse=True)
    assert runner is not None and runner.deployment != result.deployment
    assert runner.goodput == simulated[1]  # the second best simulated, whatever its label
    assert result.margin == pytest.approx((result.goodput - runner.goodput) / result.goodput)
    assert result.to_dict()["runner_up"]["margin"] == result.margin


def test_two_instances_split_as_the_hybrids_and_one_does_not_split() -> None:
    """`trident up --method ep+d` runs two workers: the planner picks between EP+D and ED+P for
    them (there is no E+P+D partition of two) rather than refuse to plan."""
    trace = generate("textcaps", rate=2, num_requests=40, seed=3)
    result = plan(trace, PROFILES, SLO(ttft=4, tbt=0.08), 2)
    labels = {c.deployment.label for c in result.candidates}
    assert labels == {"1EP1D", "1ED1P"} and result.deployment.label in labels
    assert result.goodput > 0 and result.inputs["partition"] is None
    with pytest.raises(NoSplit, match="at least 2"):
        plan(trace, PROFILES, SLO(ttft=4, tbt=0.08), 1)
