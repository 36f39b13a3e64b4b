"""TRIDENT_PLANNER_FOLLOW_CAPACITY: a capacity recommendation that differs from what runs becomes a
plan of its own, on every channel, and the actuator is handed it (here the launcher's, whose Redis
key `trident up --follow-plan` reads); one that runs already, or is on its way, is not handed on
again. Real nats-server and redis-server; the planner's loop idles (no requests to plan)."""

from __future__ import annotations

import contextlib

import pytest

from common.bus import Bus, BusConfig
from common.planner.capacity import Capacity, recommend
from common.planner.limits import Limits
from common.planner.paper_profiles import paper_profiles
from common.planner.workloads import generate
from common.protocol import Plan, decode
from common.stats import SLO
from services.planner.planner import Planner
from services.settings import PlannerSettings
from tests.substrate.helpers import run


@pytest.fixture
def capacity() -> Capacity:
    """What the planner recommends for 30 req/s of TextCaps (~2 s to search: done when a test asks,
    not when the module is collected)."""
    return recommend(
        generate("textcaps", rate=5, num_requests=80, seed=7), paper_profiles("llava-1.5-7b"), SLO(4, 0.08),
        30.0, Limits(budget=12.0),
    )  # fmt: skip


def test_a_recommendation_that_differs_from_what_runs_is_handed_to_the_actuator(
    nats_server, redis_server, capacity
):
    settings = PlannerSettings(
        nats_url=nats_server.url, redis_url=redis_server.url, planner_actuator="launcher",
        planner_follow_capacity=True, http_port=0,
    )  # fmt: skip
    wanted = capacity.deployment

    async def main() -> None:
        planner = Planner(settings)
        await planner.start()
        watcher = await Bus.connect(BusConfig(url=nats_server.url, name="test-follow"))
        plans = await watcher.events.plans()
        try:
            await planner._follow(capacity, {"epd": 1})
            event = await plans.get(timeout=10)
            assert isinstance(event, Plan) and (event.method, event.replicas) == (
                wanted.method,
                wanted.counts,
            )
            assert event.reason.startswith(f"capacity: 30 req/s forecast needs {wanted.label}")
            handed = decode(await planner.store.redis.get(planner.store.keys.plan_apply), expect=Plan)
            assert handed.decision_id == event.decision_id
            # On its way (the current plan), or running: not handed on again.
            await planner._follow(capacity, {"epd": 1})
            await planner._follow(capacity, dict(wanted.counts))
            with contextlib.suppress(TimeoutError):
                extra = await plans.get(timeout=1.0)
                raise AssertionError(f"handed on again: {extra}")
            assert (await planner.store.planning.current_plan()).decision_id == event.decision_id
        finally:
            await watcher.close()
            await planner.close()

    run(main())
