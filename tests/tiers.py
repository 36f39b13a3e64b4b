"""The suite's two tiers: `make test-fast` runs every test not marked slow, `make test` runs all.

A test is slow when it starts a deployment: one of our services as its own process (a cluster from
trident/launcher/cluster.py, the planner), `trident up` (real or with stand-in services), or Docker
Compose. Those take tens of seconds each, and so does a benchmark run whole on the CPU, a
property sweep or an external validator run over every rendered object (tests/bench,
tests/stages/test_ledger_property.py, the schema and checkov checks), which are slow too; everything
else (the engine against HF, the substrate against a real nats-server and redis-server, in-process
services) stays in the fast tier.

Every test under tests/services and tests/docker runs against a deployment and is marked slow by
its folder (SLOW_FOLDERS); elsewhere a slow test or module says so itself (`@pytest.mark.slow`,
`pytestmark = pytest.mark.slow`). tests/conftest.py fails a test that starts a deployment without
the mark, in either tier, so the fast tier cannot grow slow unnoticed.
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePath

import pytest

TESTS = Path(__file__).resolve().parent
SLOW_FOLDERS = (TESTS / "services", TESTS / "docker")
# Raised (sys.audit) by the launcher's clusters for each process they start, forked ones included,
# which no subprocess.Popen event announces.
START_EVENT = "trident.launcher.start"
# Raised where the suite starts a deployment itself (a cluster, a Compose stack, hosts in network
# namespaces): the run counts them (tests/conftest.py), with the `trident up` runs and peer servers
# it sees started as processes (`deployment_kind`).
DEPLOY_EVENT = "tests.deployment"


def count_deployment(kind: str) -> None:
    """Count one deployment of `kind` in this run's total."""
    sys.audit(DEPLOY_EVENT, kind)


def deployment_kind(argv: list[str]) -> str | None:
    """What a process started with `argv` adds to the run's deployments, if anything: a `trident up`
    (over stand-in services: tests/helpers/stand_in_up.py), a peer server, a service on its own.
    None for a process of a cluster or a Compose stack (counted where they start) and the rest."""
    if not starts_a_deployment(argv) or PurePath(argv[0]).name == "docker":
        return None
    args = " ".join(argv[1:])
    if any(a.startswith(("services.", "--app=services.")) for a in argv[1:]):
        # A service's own process (`-m services.gateway`, the planner's Celery app), not the probe
        # run inside one (`-m services.worker.probe`, as Kubernetes runs it).
        return None if any(a.endswith(".probe") for a in argv[1:]) else "service process"
    if "serve" in argv[1:]:
        return "peer server"
    return "trident up (stand-ins)" if "compose.test.yaml" in args else "trident up"


def mark_slow_folders(items: list[pytest.Item]) -> None:
    """Mark every test under SLOW_FOLDERS slow."""
    for item in items:
        if any(item.path.is_relative_to(folder) for folder in SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)


def starts_a_deployment(argv: list[str]) -> bool:
    """Whether a process started with `argv` is (or starts) a deployment of services."""
    if not argv:
        return False
    args = argv[1:]
    # The CLI itself, or `python -c` over it or over the launcher's `up`.
    launcher = PurePath(argv[0]).name in ("trident", "docker") or any(
        "trident.cli" in a or "trident.launcher" in a for a in args
    )
    if launcher and ("up" in args or "trident.cli.up import up" in " ".join(args)):
        return True  # `trident up`, `docker compose up`, `up` over stand-in services
    if any(a.startswith(("services.", "--app=services.")) for a in args):
        return True  # python -m services.worker, the planner's Celery worker
    return "serve" in args  # transformers serve, llama-server: a peer the benchmarks run
