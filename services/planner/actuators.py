"""What the planner does with a decision besides publishing it.

- `advisory` (default): nothing; the plan is in Redis, on NATS, at GET /plan and in /metrics.
- `launcher`: asks a `trident up --follow-plan` to run it, by writing the plan to `<p>:plan:apply`;
  the launcher starts the new replicas, waits for them to register, then drains the old ones
  (trident/launcher/follow.py).
- `compose`: the `docker compose ... up -d --scale ...` command that runs it, logged, or run with
  TRIDENT_PLANNER_COMPOSE_RUN (where the planner runs on the Docker host).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from pathlib import Path
from typing import Protocol

from common.compose import ComposeFile, Method, load_compose, plan_scale
from common.protocol import Plan, decode
from common.store import Store
from services.settings import PlannerSettings

log = logging.getLogger(__name__)


class Actuator(Protocol):
    name: str

    async def apply(self, plan: Plan) -> None: ...


class Advisory:
    """Recommends only."""

    name = "advisory"

    async def apply(self, plan: Plan) -> None:
        log.info("plan %d: %s %s (advisory: nothing changed)", plan.decision_id, plan.method, plan.replicas)


class LauncherActuator:
    """Hands the plan to `trident up --follow-plan` through Redis; a plan equal to the one already
    handed over (same method and replicas) is not written again."""

    name = "launcher"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def apply(self, plan: Plan) -> None:
        key = self.store.keys.plan_apply
        raw = await self.store.redis.get(key)
        if raw is not None:
            current = decode(raw, expect=Plan)
            if (current.method, current.replicas) == (plan.method, plan.replicas):
                log.info(
                    "plan %d: trident up already runs %s %s", plan.decision_id, plan.method, plan.replicas
                )
                return
        await self.store.redis.set(key, plan.to_bytes())
        log.info("plan %d: asked trident up to run %s %s", plan.decision_id, plan.method, plan.replicas)


def compose_command(compose: ComposeFile, plan: Plan, file: Path | str = "compose.yaml") -> list[str]:
    """`docker compose` arguments that scale the file's workers to the plan. Every hybrid profile is
    enabled so that the services of other methods can be scaled to 0 (a disabled profile's running
    containers would be left alone)."""
    counts = plan_scale(compose, Method(plan.method), plan.replicas)
    workers = compose.all_workers
    profiles = sorted({p for name in workers for p in compose.services[name].profiles})
    argv = ["docker", "compose", "-f", str(file)]
    for profile in profiles:
        argv += ["--profile", profile]
    argv += ["up", "-d"]
    for name in workers:
        argv += ["--scale", f"{name}={counts.get(name, 0)}"]
    return argv


class ComposeActuator:
    """Scales Docker Compose to the plan: logs the command, and runs it when `run` is set."""

    name = "compose"

    def __init__(self, file: Path, run: bool = False) -> None:
        self.file = file
        self.compose = load_compose(file, os.environ)  # fails at start-up, not at the first plan
        self.run = run
        self.last: list[str] | None = None

    async def apply(self, plan: Plan) -> None:
        argv = compose_command(self.compose, plan, self.file)
        self.last = argv
        line = shlex.join(argv)
        if not self.run:
            log.info("plan %d: to apply it, run: %s", plan.decision_id, line)
            return
        log.info("plan %d: running %s", plan.decision_id, line)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        tail = out.decode(errors="replace")[-2000:]
        if proc.returncode:
            log.error("plan %d: %s exited %d:\n%s", plan.decision_id, argv[0], proc.returncode, tail)
        else:
            log.info("plan %d: applied", plan.decision_id)


def make_actuator(settings: PlannerSettings, store: Store) -> Actuator:
    if settings.planner_actuator == "launcher":
        return LauncherActuator(store)
    if settings.planner_actuator == "compose":
        return ComposeActuator(settings.planner_compose_file, settings.planner_compose_run)
    return Advisory()
