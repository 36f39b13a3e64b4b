"""`trident follow-plan`: a Docker Compose deployment runs the plans its planner makes.

It runs on the Docker host, beside `docker compose`, and needs nothing the defaults keep closed:
it reads the current plan and the live instances from the gateway (`GET /v1/cluster`, the one
published port) and changes the deployment with the compose CLI. Each new decision is applied in
two steps, so no role is ever left without an instance:

    plan 4: 1E1P1D -> 2EP2D   up -d --scale worker-ep=2 --scale decode=2 (encoder, prefill kept)
                              ... once the registry lists 2 EP and 2 D instances ...
                              up -d --scale encoder=0 --scale prefill=0: compose stops them with
                              SIGTERM, and they drain (finish what they hold) within their grace
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from common.compose import ComposeFile, Method, plan_scale
from common.protocol import Plan


class FollowError(RuntimeError):
    """A step could not be taken (compose failed, the gateway did not answer, replicas did not come up)."""


class ComposeProject:
    """The compose CLI on one project, every hybrid profile on so that any worker can be scaled."""

    def __init__(self, compose: ComposeFile, project: str | None, env: Mapping[str, str]) -> None:
        self.compose = compose
        self.project = project
        self.env = dict(env)
        self.profiles = sorted({p for n in compose.all_workers for p in compose.services[n].profiles})

    def argv(self, *args: str) -> list[str]:
        argv = ["docker", "compose", "-f", str(self.compose.path)]
        if self.project:
            argv += ["-p", self.project]
        for profile in self.profiles:
            argv += ["--profile", profile]
        return [*argv, *args]

    def run(self, *args: str, timeout: float = 600) -> str:
        argv = self.argv(*args)
        try:
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FollowError(f"{' '.join(argv)}: {exc}") from None
        if done.returncode != 0:
            raise FollowError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
        return done.stdout

    def running(self) -> dict[str, int]:
        """Running containers per worker service."""
        listed = self.run("ps", "--format", "json", "--status", "running")
        lines = [json.loads(line) for line in listed.splitlines() if line.strip()]
        found = Counter(c["Service"] for c in lines if c.get("Service") in self.compose.all_workers)
        return {name: found.get(name, 0) for name in self.compose.all_workers}

    def scale(self, counts: Mapping[str, int]) -> None:
        """Scale every worker service to `counts` (absent: 0); replicas kept are not recreated."""
        args = ["up", "-d", "--no-recreate"]
        for name in self.compose.all_workers:
            args += ["--scale", f"{name}={counts.get(name, 0)}"]
        self.run(*args)


class GatewayView:
    """The current plan and the live instances, as the gateway's `GET /v1/cluster` shows them."""

    def __init__(self, url: str, api_key: str = "") -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def read(self) -> tuple[Plan | None, list[dict]]:
        try:
            reply = httpx.get(self.url + "/v1/cluster", headers=self.headers, timeout=5)
            reply.raise_for_status()
            body = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise FollowError(f"cannot read {self.url}/v1/cluster: {exc}") from None
        plan = Plan.model_validate(body["plan"]) if body.get("plan") else None
        return plan, body.get("instances", [])


@dataclass
class Follower:
    """Applies each plan the gateway shows that is newer than the last one applied."""

    compose: ComposeFile
    project: ComposeProject
    view: GatewayView
    ready_timeout: float = 300.0
    echo: Callable[[str], None] = print
    applied: int = -1  # decision id of the last plan applied (or found already running)

    def step(self) -> bool:
        """One look at the plan; True if it changed the deployment."""
        plan, _ = self.view.read()
        if plan is None or plan.decision_id <= self.applied:
            return False
        target = plan_scale(self.compose, Method(plan.method), plan.replicas)
        current = self.project.running()
        self.applied = plan.decision_id
        wanted = {name: target.get(name, 0) for name in self.compose.all_workers}
        if current == wanted:
            self.echo(f"plan {plan.decision_id} ({plan.method} {plan.replicas}): already running")
            return False
        label = f"plan {plan.decision_id} ({plan.method} {plan.replicas})"
        self.echo(f"{label}: {_counts(current)} -> {_counts(wanted)}")
        grown = {name: max(current[name], wanted[name]) for name in wanted}
        if grown != current:
            self.echo(f"  starting: {_counts({n: grown[n] - current[n] for n in grown})}")
            self.project.scale(grown)
            self._wait_registered(wanted)
        if grown != wanted:
            self.echo(f"  draining: {_counts({n: grown[n] - wanted[n] for n in grown})}")
            self.project.scale(wanted)
        self.echo(f"plan {plan.decision_id}: applied")
        return True

    def _wait_registered(self, wanted: Mapping[str, int]) -> None:
        """Until the registry lists as many instances of each service's roles as the plan wants."""
        roles_of = {name: tuple(sorted(self.compose.services[name].roles)) for name in wanted}
        deadline = time.monotonic() + self.ready_timeout
        while True:
            _, instances = self.view.read()
            live = Counter(tuple(sorted(i["roles"])) for i in instances)
            short = {n: k for n, k in wanted.items() if k and live[roles_of[n]] < k}
            if not short:
                return
            if time.monotonic() > deadline:
                raise FollowError(
                    f"after {self.ready_timeout:.0f} s the registry still lacks {_counts(short)}; "
                    "nothing was drained"
                )
            time.sleep(1.0)


def _counts(counts: Mapping[str, int]) -> str:
    shown = [f"{n}={k}" for n, k in counts.items() if k]
    return ", ".join(shown) or "none"


def default_gateway(env: Mapping[str, str]) -> str:
    return f"http://127.0.0.1:{env.get('TRIDENT_PORT') or '8000'}"
