"""A substrate that survives losing a node: NATS as a three-node cluster (JetStream keeps three
copies of the task stream), Redis as a primary with a replica and three sentinels that promote the
replica when the primary dies.

    with NatsCluster(workdir, ["127.0.0.1"] * 3, token) as nats, RedisGroup(workdir, [...], pw) as redis:
        nats.url    # nats://tok@h1:p1,nats://tok@h2:p2,nats://tok@h3:p3   (TRIDENT_NATS_URL)
        redis.url   # redis+sentinel://:pw@h1:s1,h2:s2,h3:s3/trident/0      (TRIDENT_REDIS_URL)

Each node may run on another "host" (`wrap`: `ip netns exec NAME`), so every port is fixed up front.
Used by `trident up --ha`, bench/faults.py and the network-namespace tests.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from common.infra.nats_server import ClusterNode, NatsServer
from common.infra.process import InfraError, LocalServer, free_port
from common.infra.redis_server import RedisServer
from common.infra.sentinel import FAILOVER_TIMEOUT_MS, RedisSentinel
from common.tls import Tls

log = logging.getLogger(__name__)

Wrap = Callable[[int], list[str]]  # node index -> the command prefix that puts it on its host


def _ports(hosts: Sequence[str], given: Sequence[int] | None) -> list[int]:
    return list(given) if given else [free_port(h) for h in hosts]


def _wait(what: str, check: Callable[[], bool], timeout: float, servers: Sequence[LocalServer]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    tails = "\n".join(f"--- {s.name} {s.host}:{s.port}\n{s.log_tail(8)}" for s in servers)
    raise InfraError(f"{what} not within {timeout:.0f} s:\n{tails}")


def _place(servers: Sequence[LocalServer], prefix: str, wrap: Wrap | None) -> None:
    """Name the i-th server `<prefix>-<i+1>` and put it on its host."""
    for i, server in enumerate(servers):
        server.name = f"{prefix}-{i + 1}"
        server.wrap = wrap(i) if wrap else []


class _Group:
    """Start, stop and context-manager plumbing shared by the two groups."""

    servers: list[LocalServer]

    def start(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class NatsCluster(_Group):
    """Three (or more) nats-servers routed to each other, each with JetStream."""

    def __init__(
        self,
        workdir: Path,
        hosts: Sequence[str],
        token: str | None = None,
        ports: Sequence[int] | None = None,
        wrap: Wrap | None = None,
        tls: Tls | None = None,
    ) -> None:
        client = _ports(hosts, ports)
        if ports is not None:  # fixed client ports: the others next to them, as on another host
            route, monitor = [p + 1 for p in client], [p + 2 for p in client]
        else:
            route, monitor = _ports(hosts, None), _ports(hosts, None)
        routes = [f"{h}:{p}" for h, p in zip(hosts, route, strict=True)]
        self.nodes = [
            NatsServer(
                workdir=workdir / f"nats-{i + 1}",
                port=client[i],
                host=host,
                token=token,
                monitor_port=monitor[i],
                cluster=ClusterNode(f"nats-{i + 1}", route[i], tuple(r for r in routes if r != routes[i])),
                tls=tls,
            )
            for i, host in enumerate(hosts)
        ]
        _place(self.nodes, "nats", wrap)
        self.servers = list(self.nodes)

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    @property
    def address(self) -> str:
        return ",".join(node.address for node in self.nodes)

    def start(self, timeout: float = 30.0) -> None:
        for node in self.nodes:
            node.start(timeout)
        _wait("a JetStream meta leader and every peer", self.settled, timeout, self.nodes)

    def settled(self) -> bool:
        """Every live node names the same meta leader, and the leader has every peer current."""
        leaders = set()
        for node in self.nodes:
            if not node.running:
                continue
            meta = _jsz(node.monitor_url).get("meta_cluster") or {}
            peers = meta.get("replicas") or []
            if not meta.get("leader") or len(peers) != len(self.nodes) - 1:
                return False
            if meta["leader"] == node.name and not all(p.get("current") for p in peers):
                return False
            leaders.add(meta["leader"])
        return len(leaders) == 1

    def stream_leader(self) -> NatsServer | None:
        """The node that leads the task stream (the first stream its peers report), if any."""
        name = stream_leader(n.monitor_url for n in self.nodes if n.running)
        return next((n for n in self.nodes if n.name == name), None)


def stream_leader(monitors: Iterable[str]) -> str | None:
    """The name of the node leading a replicated stream, asked of nodes' monitoring URLs in turn."""
    for monitor in monitors:
        for account in _jsz(monitor, "?streams=true").get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                leader = (stream.get("cluster") or {}).get("leader")
                if leader:
                    return leader
    return None


def _jsz(monitor: str, query: str = "") -> dict:
    try:
        with urllib.request.urlopen(f"{monitor}/jsz{query}", timeout=1.0) as resp:
            return json.loads(resp.read() or b"{}")
    except (OSError, urllib.error.URLError, ValueError):
        return {}


class RedisGroup(_Group):
    """A sentinel on every host; the primary on the first, a replica on each of the next
    `replicas` (one by default: on three hosts, the third runs a sentinel only)."""

    def __init__(
        self,
        workdir: Path,
        hosts: Sequence[str],
        password: str | None = None,
        ports: Sequence[int] | None = None,
        wrap: Wrap | None = None,
        service: str = "trident",
        replicas: int = 1,
        tls: Tls | None = None,
    ) -> None:
        if not 0 < replicas < len(hosts):
            raise ValueError(f"{len(hosts)} hosts hold a primary and 1 to {len(hosts) - 1} replicas")
        data = _ports(hosts, ports)
        watch = [p + 1 for p in data] if ports is not None else _ports(hosts, None)
        self.service = service
        self.password = password
        self.nodes = [
            RedisServer(workdir=workdir / f"redis-{i + 1}", port=data[i], host=h, password=password, tls=tls)
            for i, h in enumerate(hosts[: replicas + 1])
        ]
        first = (self.nodes[0].host, self.nodes[0].port)
        quorum = len(hosts) // 2 + 1
        self.sentinels = [
            RedisSentinel(first, workdir / f"sentinel-{i + 1}", watch[i], h, password, service, quorum, tls)
            for i, h in enumerate(hosts)
        ]
        for node in self.nodes[1:]:
            node.primary = lambda: first
        _place(self.nodes, "redis", wrap)
        _place(self.sentinels, "sentinel", wrap)
        self.servers = [*self.nodes, *self.sentinels]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}{self._where}"

    @property
    def address(self) -> str:
        return f"redis+sentinel://{self._where}"

    @property
    def _where(self) -> str:
        return ",".join(s.address for s in self.sentinels) + f"/{self.service}/0"

    def start(self, timeout: float = 30.0) -> None:
        for node in self.nodes:
            node.start(timeout)
        for sentinel in self.sentinels:
            # What a sentinel of an earlier group in this folder learned names its servers, not ours.
            (sentinel.workdir / "sentinel.conf").unlink(missing_ok=True)
            sentinel.start(timeout)
        _wait("sentinels that know each other and the replicas", self.settled, timeout, self.servers)
        for node in self.nodes:  # from now on a restart asks the sentinels whom to follow
            node.primary = self._primary_for(node)

    def settled(self) -> bool:
        want = len(self.sentinels) - 1
        for sentinel in self.sentinels:
            state = sentinel.state()
            if state is None or state.get("num-other-sentinels", 0) < want:
                return False
            if state.get("num-slaves", 0) < len(self.nodes) - 1 or state.get("flags") != "master":
                return False
        return all(node.replicating() for node in self.nodes[1:])

    def primary(self) -> tuple[str, int] | None:
        """The primary the sentinels name (the first that answers), or None if none answers."""
        for sentinel in self.sentinels:
            state = sentinel.state() if sentinel.running else None
            if state is not None:
                return state["ip"], int(state["port"])
        return None

    def primary_node(self) -> RedisServer | None:
        where = self.primary()
        return next((n for n in self.nodes if (n.host, n.port) == where), None)

    def _primary_for(self, node: RedisServer) -> Callable[[], tuple[str, int] | None]:
        """What `node` replicates when it restarts. A primary that died comes back empty (no
        persistence): started as a primary again before the sentinels noticed, it would be
        replicated, emptiness and all. So it waits for them to promote another, and follows that."""

        def resolve() -> tuple[str, int] | None:
            deadline = time.monotonic() + 2 * FAILOVER_TIMEOUT_MS / 1000
            while True:
                where = self.primary()
                if where is None:
                    log.warning("no sentinel answers; %s starts as a primary", node.name)
                    return None
                if where != (node.host, node.port):
                    return where
                if time.monotonic() >= deadline:
                    log.warning("the sentinels still name %s the primary; it starts as one", node.name)
                    return None
                time.sleep(0.2)

        return resolve
