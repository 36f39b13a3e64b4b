"""compose.yaml run by a real Docker engine, as users run it: one stack per module, torn down after.

Skipped, with the reason, when no engine answers (`docker info` fails); `.ci/run` starts one where
the machine can have it, so CI runs these.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.infra import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
UP_TIMEOUT = 900  # a cold build installs the project's dependencies into the image


def engine_problem() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        subprocess.run(["docker", "info"], capture_output=True, check=True, timeout=20)
        subprocess.run(["docker", "compose", "version"], capture_output=True, check=True, timeout=20)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"no Docker engine with Compose v2 answers ({exc})"
    return None


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    url: str

    def argv(self, *args: str) -> list[str]:
        return ["docker", "compose", "-p", self.project, "-f", str(COMPOSE), *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = self.argv(*args)
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        return done

    def running(self) -> list[str]:
        """Names of this project's containers that run now."""
        out = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return out.split()

    def instances(self, role: str) -> list[dict]:
        found = httpx.get(self.url + "/v1/cluster", timeout=10).json()["instances"]
        return [i for i in found if role in i["roles"]]

    def wait_for(self, check, timeout: float = 300.0) -> None:  # a bound: a busy host starts them slowly
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "not reached in time"
            time.sleep(0.5)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", check=False).stdout


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
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
    s = Stack(project=f"trident-test-{port}", env=env, url=f"http://127.0.0.1:{port}")
    try:
        # Two decode replicas from the start: the failover tests need them, and scaling up later
        # (which follow-plan and the hybrid profiles do) starts a container on a busy host again.
        up = ("up", "-d", "--build", "--scale", "decode=2", "--wait", "--wait-timeout", "300")
        s.compose(*up, timeout=UP_TIMEOUT)
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        every = ("--profile", "ep-d", "--profile", "ed-p", "--profile", "epd")
        s.compose(*every, "down", "-v", "--remove-orphans", "--timeout", "60", timeout=300, check=False)
    assert s.running() == [], "docker compose down left containers running"
