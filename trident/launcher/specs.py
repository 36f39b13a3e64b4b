"""The local processes compose.yaml stands for: each service replica's command and environment on this
machine, with the containers' world (hostnames, volumes, fixed ports) replaced by local servers and paths."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.compose import ComposeFile, Method, Service, map_hosts, resolve_scale
from common.threads import thread_split


@dataclass(frozen=True)
class LocalSetup:
    """What replaces the containers' world on this machine."""

    model: Path
    port: int
    hosts: Mapping[str, str]  # compose hostname -> "127.0.0.1:PORT" of the local server
    cpus: int
    user_env: Mapping[str, str]  # the caller's environment; its TRIDENT_NUM_THREADS wins over the split
    secrets_dir: Path | None = None  # the deployment's secrets (common/secrets.py), for every service
    # The workers' shared core board (services/worker/cores.py), used unless the caller fixed the threads.
    core_board: Path | None = None
    # Variables set on one service's processes over everything else (the planner's port and actuator).
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # compose hostname -> the whole URL of a local group of servers (trident up --ha; substrate.py)
    urls: Mapping[str, str] = field(default_factory=dict)
    substrate_env: Mapping[str, str] = field(default_factory=dict)  # for every process (substrate.py)


@dataclass(frozen=True)
class ProcessSpec:
    """One local process: a compose service replica with its command and environment."""

    name: str  # like compose's containers: <service>-<n>
    service: str
    argv: tuple[str, ...]
    env: dict[str, str]  # the compose environment with the local overrides; the caller's env goes under it
    roles: tuple[str, ...]
    restart: str
    stop_grace: float
    gateway: bool = False


def local_argv(command: tuple[str, ...]) -> tuple[str, ...]:
    """The container's `python` is this interpreter, so children run in the same environment."""
    if command and command[0] in ("python", "python3"):
        return (sys.executable, *command[1:])
    return command


def _local_env(setup: LocalSetup) -> dict[str, str]:
    env = {
        "TRIDENT_MODEL": str(setup.model),
        "TRIDENT_BIND_HOST": "127.0.0.1",
        "TRIDENT_ADVERTISE_HOST": "127.0.0.1",
        # Children write to log files; unbuffered output keeps the logs current.
        "PYTHONUNBUFFERED": "1",
    }
    if setup.secrets_dir is not None:
        env["TRIDENT_SECRETS_DIR"] = str(setup.secrets_dir)
    env.update(setup.substrate_env)
    return env


def plan(
    compose: ComposeFile, method: Method, scale: Mapping[str, int], setup: LocalSetup
) -> list[ProcessSpec]:
    """The processes for `method`: workers, then the services run for every method (the planner), then
    the gateway (the order they start in)."""
    counts = resolve_scale(compose, method, scale)
    specs: list[ProcessSpec] = []
    for name, count in counts.items():
        specs += [worker_spec(compose, name, i, setup, sum(counts.values())) for i in range(1, count + 1)]
    specs += [service_spec(compose, name, 1, setup) for name in compose.always]
    specs.append(gateway_spec(compose, setup))
    return specs


def service_spec(compose: ComposeFile, service: str, index: int, setup: LocalSetup) -> ProcessSpec:
    """Replica `index` of a service that is neither a worker nor the gateway (the planner, its jobs)."""
    return _spec(compose.services[service], index, setup, {**_local_env(setup), "TRIDENT_HTTP_PORT": "0"})


def gateway_spec(
    compose: ComposeFile, setup: LocalSetup, index: int = 1, port: int | None = None
) -> ProcessSpec:
    """Replica `index` of the gateway, serving on `port` (the setup's by default)."""
    served = str(setup.port if port is None else port)
    env = {**_local_env(setup), "TRIDENT_PORT": served, "TRIDENT_HTTP_PORT": served}
    return _spec(compose.services[compose.gateway], index, setup, env, gateway=True)


def worker_spec(
    compose: ComposeFile, service: str, index: int, setup: LocalSetup, workers: int
) -> ProcessSpec:
    """Replica `index` of a worker service, its torch threads a share of the cores among `workers`."""
    env = {**_local_env(setup), "TRIDENT_HTTP_PORT": "0"}
    if "TRIDENT_NUM_THREADS" not in setup.user_env:
        env["TRIDENT_NUM_THREADS"] = str(thread_split(setup.cpus, workers))
        if setup.core_board is not None:  # the split under load; all the cores a step finds idle
            env["TRIDENT_CORE_BOARD"] = str(setup.core_board)
            env["TRIDENT_HOST_CORES"] = str(setup.cpus)
    return _spec(compose.services[service], index, setup, env)


def _spec(
    service: Service, index: int, setup: LocalSetup, overrides: dict[str, str], gateway: bool = False
) -> ProcessSpec:
    env = {key: map_hosts(value, setup.hosts, setup.urls) for key, value in service.environment.items()}
    env.update(overrides)
    env.update(setup.service_env.get(service.name, {}))
    return ProcessSpec(
        name=f"{service.name}-{index}",
        service=service.name,
        argv=local_argv(service.command),
        env=env,
        roles=service.roles,
        restart=service.restart,
        stop_grace=service.stop_grace,
        gateway=gateway,
    )
