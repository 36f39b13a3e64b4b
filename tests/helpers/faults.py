"""The deployments the fault tests strike (tests/services/test_failover.py, test_recovery.py): two of
every worker, so a victim always has a survivor, shared by both modules; and `heal`, which after
each test restarts what the test killed, stopped or left frozen, so the next test starts from the
whole deployment instead of a fresh one. And `replaced_decoder`: a shared deployment's decoders
swapped for one configured otherwise, for a while, and put back."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.helpers.deployments import Deployment
from tests.helpers.probes import instances, pid_of, wait_for
from trident.launcher.cluster import Cluster

# Far beyond any failover: a request that moved on by its ack deadline would fail the stall checks.
SLOW_ACK = {"TRIDENT_TASK_ACK_WAIT": "30"}
# E+P+D with two of each stage, and EPD with two instances.
TWO_OF_EACH = Deployment.of(method="e+p+d", scale={"encoder": 2, "prefill": 2, "decode": 2}, env=SLOW_ACK)
TWO_EPD = Deployment.of(method="epd", scale={"worker-epd": 2}, env=SLOW_ACK)
HEAL_TIMEOUT = 120.0  # seconds: a restarted worker loads and profiles the model again


def healed(cluster: Cluster) -> Iterator[Cluster]:
    """The body of a test's fixture over a struck deployment: the deployment whole (every worker
    registered: a fresh one may still be joining), and healed afterwards."""
    heal(cluster)
    yield cluster
    heal(cluster)


def heal(cluster: Cluster) -> None:
    """Wake every frozen process, restart every one that ended (its compose spec, on its port), and
    wait until exactly the live workers are registered and none of them drains (the dead fenced or
    expired; one told to stop has left, and is restarted) and the gateway is ready."""
    for child in cluster.children.values():
        child.signal(signal.SIGCONT)
    deadline = time.monotonic() + HEAL_TIMEOUT
    while True:
        for child in cluster.children.values():
            if not child.running:  # ended before this heal, or a drain that finished during it
                child.start()
        workers = {child.pid for name, child in cluster.children.items() if name != "gateway"}
        if (now := registered(cluster)) == workers:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"not whole again within {HEAL_TIMEOUT:.0f} s: {now} != {workers}")
        time.sleep(0.2)
    cluster.wait_ready(HEAL_TIMEOUT)


def registered(cluster: Cluster) -> set[int] | None:
    """The pids of the workers the gateway lists and that do not drain (None while it does not
    answer; a gateway has no roles): a draining worker is on its way out, so it does not count."""
    try:
        return {pid_of(i) for i in cluster.instances() if i["roles"] and not i["draining"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def name_of_pid(cluster: Cluster, pid: int) -> str:
    (name,) = [n for n, p in cluster.procs.items() if p.pid == pid]
    return name


@contextmanager
def replaced_decoder(cluster: Cluster, name: str, **env: str) -> Iterator[Cluster]:
    """The deployment, whole, with its decode instances replaced by one, `name`, a replica of
    compose's decode service under `env`; afterwards the plain ones back on their own specs, and the
    deployment whole again."""
    heal(cluster)
    specs = {n: c.spec for n, c in cluster.children.items() if c.spec.service == "decode"}
    cluster.start(name, "services.decode", **env)
    try:
        wait_for(lambda: len(instances(cluster, "decode")) == len(specs) + 1, what=f"{name} registered")
        for plain in specs:
            cluster.stop(plain)  # the plain decoders drain and leave
        wait_for(lambda: len(instances(cluster, "decode")) == 1, what=f"{', '.join(specs)} gone")
        yield cluster
    finally:
        if name in cluster.procs:
            cluster.stop(name)
        for plain, spec in specs.items():
            if plain not in cluster.procs:
                cluster.start_spec(spec)
        heal(cluster)
