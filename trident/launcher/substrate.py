"""The servers `trident up` starts in place of compose's nats and redis services: one of each, or
with `--ha` a three-node NATS cluster (the task stream kept three times) and a Redis primary with a
replica behind three sentinels (common/infra/ha.py), all on loopback ports.

The services are pointed at them by rewriting the URLs that name the compose hostnames: a single
server by host and port (`nats://nats:4222` -> `nats://127.0.0.1:N`), a group by the whole URL
(`redis://redis:6379/0` -> `redis+sentinel://127.0.0.1:S1,.../trident/0`). Credentials come from
the deployment's secrets directory, as for the single servers. With the deployment's TLS (`--tls`),
every server takes members only (mutual TLS), and every service is told the folder
(TRIDENT_TLS_DIR).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.infra import LocalServer, NatsServer, RedisServer
from common.infra.ha import NatsCluster, RedisGroup
from common.infra.settings import NATS
from common.secrets import DeploymentSecrets
from common.tls import Tls

Echo = Callable[..., None]
LOOPBACK = ["127.0.0.1"] * NATS.cluster_nodes  # common/infra/settings.py, as compose and Kubernetes


@dataclass
class Substrate:
    servers: dict[str, LocalServer] = field(default_factory=dict)  # by name, in the order started
    hosts: dict[str, str] = field(default_factory=dict)  # compose hostname -> "host:port" (one server)
    urls: dict[str, str] = field(default_factory=dict)  # compose hostname -> whole URL (a group)
    redis_url: str = ""  # with the password: for the launcher's own reads (--follow-plan)
    env: dict[str, str] = field(default_factory=dict)  # for every service: how to use the servers

    def stop(self) -> None:
        for server in reversed(list(self.servers.values())):
            server.stop()


@dataclass(frozen=True)
class SubstrateSetup:
    """Where the servers keep their files and logs, the credentials they ask for, and how: one of
    each or groups (`ha`), with the deployment's TLS or without."""

    home: Path
    logs: Path
    secrets: DeploymentSecrets
    ha: bool = False
    tls: Tls | None = None


def start_substrate(found: Substrate, kinds: dict[str, str], setup: SubstrateSetup, echo: Echo) -> None:
    """Start a server (or a group) for each compose service in `kinds` (service -> "nats" | "redis")
    into `found`, which holds every server before it starts: when a later start fails, the caller
    stops what did."""
    tls, secrets = setup.tls, setup.secrets
    if tls is not None:
        found.env["TRIDENT_TLS_DIR"] = str(tls.folder.resolve())
    for service, kind in kinds.items():
        workdir = setup.home / service
        if kind == "nats":
            # A fresh task stream, as a new nats container would have: no stale tasks from a past run.
            for store in [workdir / "jetstream", *workdir.glob("nats-*/jetstream")]:
                shutil.rmtree(store, ignore_errors=True)
        if not setup.ha:
            server: NatsServer | RedisServer = (
                NatsServer(workdir=workdir, token=secrets.nats_token, tls=tls)
                if kind == "nats"
                else RedisServer(workdir=workdir, password=secrets.redis_password, tls=tls)
            )
            _prepare(found, service, server, setup.logs)
            server.start()
            echo(f"{service}: {server.address} (log {server.log_path})")
            found.hosts[service] = f"{server.host}:{server.port}"
            if isinstance(server, RedisServer):
                found.redis_url = server.url
            continue
        group = (
            NatsCluster(workdir, LOOPBACK, secrets.nats_token, tls=tls)
            if kind == "nats"
            else RedisGroup(workdir, LOOPBACK, secrets.redis_password, tls=tls)
        )
        for server in group.servers:
            _prepare(found, server.name, server, setup.logs)
        group.start()
        for server in group.servers:
            echo(f"{server.name}: {server.host}:{server.port} (log {server.log_path})")
        found.urls[service] = group.address
        if isinstance(group, NatsCluster):
            found.env["TRIDENT_NATS_STREAM_REPLICAS"] = str(len(group.nodes))
        if isinstance(group, RedisGroup):
            found.redis_url = group.url


def _prepare(found: Substrate, name: str, server: LocalServer, logs: Path) -> None:
    server.log_path = logs / f"{name}.log"
    server.die_with_parent = True  # a SIGKILLed `trident up` leaves no server holding its port
    found.servers[name] = server
