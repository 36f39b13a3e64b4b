"""compose.yaml run by a real Docker engine, as users run it: one stack per module, torn down after.

Skipped, with the reason, when no engine answers (`docker info` fails); `.ci/run` starts one where
the machine can have it, so CI runs these: test_compose_up.py in `make test` (the smoke test), the
rest (marked `extended`) in CI's second step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from common.infra import free_port
from tests.docker.stack import UP_TIMEOUT, Stack, engine_problem, settings_override
from tests.tiers import count_deployment


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    problem = engine_problem()
    if problem is not None:
        pytest.skip(problem)
    port = free_port()
    env = {
        **os.environ,
        "TRIDENT_PORT": str(port),
        "TRIDENT_PLANNER_PORT": str(free_port()),
        "TRIDENT_LOG_LEVEL": "INFO",
        # The planner plans for 4 instances (a change, whatever runs) once 10 requests have finished.
        "TRIDENT_PLANNER_INSTANCES": "4",
        "TRIDENT_PLANNER_MIN_REQUESTS": "10",
    }
    overrides = (settings_override(tmp_path_factory.mktemp("compose") / "test-settings.yaml"),)
    s = Stack(project=f"trident-test-{port}", env=env, url=f"http://127.0.0.1:{port}", overrides=overrides)
    try:
        # Two decode replicas from the start: the kill and stop tests need them, and scaling up
        # later (which follow-plan and the hybrid profiles do) starts a container on a busy host again.
        up = ("up", "-d", "--build", "--scale", "decode=2", "--wait", "--wait-timeout", "300")
        count_deployment("docker compose")
        s.compose(*up, timeout=UP_TIMEOUT)
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        every = ("--profile", "ep-d", "--profile", "ed-p", "--profile", "epd")
        s.compose(*every, "down", "-v", "--remove-orphans", "--timeout", "60", timeout=300, check=False)
    assert s.running() == [], "docker compose down left containers running"
