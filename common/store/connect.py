"""Redis clients from a URL: one server, or whichever server the sentinels name the primary.

    redis://[:password@]host:port/db            one server (rediss:// with TLS)
    redis+sentinel://[:password@]h1:p1,h2:p2,h3:p3/service/db
                                                the primary of `service`, asked of the sentinels
                                                (the password is the primary's and the sentinels')

With the deployment's TLS (`tls`), every connection, to the sentinels too, is TLS with our
certificate shown, and a redis:// URL is taken as rediss://.

A sentinel client finds the primary again after a failover: a command on a connection to the old
primary fails (refused, or READONLY once it is demoted), the retry asks the sentinels again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import SSLConnection

from common.tls import Tls, redis_tls

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    password: str | None


def sentinel_target(url: str) -> SentinelTarget | None:
    """The sentinels, service and db a redis+sentinel:// URL names; None for any other URL."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    auth, _, where = parts.netloc.rpartition("@")
    password = unquote(auth.partition(":")[2]) or None if auth else None
    sentinels = []
    for item in where.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{SENTINEL_SCHEME} URL: {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{SENTINEL_SCHEME} URL must end in /SERVICE or /SERVICE/DB, not {parts.path!r}")
    return SentinelTarget(tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0, password)


def _sentinel_options(target: SentinelTarget, timeout: float, tls: Tls | None) -> dict[str, Any]:
    return {
        "password": target.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        **redis_tls(tls, flag=True),
    }


def _with_tls(url: str, tls: Tls | None) -> str:
    """One server's URL, as rediss:// when the deployment speaks TLS."""
    if tls is not None and url.startswith("redis://"):
        return "rediss://" + url.removeprefix("redis://")
    return url


class _PrimaryConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """Asks the sentinels for the primary at every connect attempt. redis-py's own class asks only
    on a first connect; a reconnect after the primary died dialled the dead address until its
    retries ran out, though the sentinels had long promoted a replica."""

    async def _connect(self) -> None:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


class _PrimarySSLConnection(_PrimaryConnection, SSLConnection):
    """The same, over TLS."""


class _BlockingSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool, BlockingConnectionPool):
    """The sentinel pool with BlockingConnectionPool's waiting for a free connection, as the
    one-server client has (a burst of requests waits for a connection instead of failing)."""


def async_client(
    url: str, timeout: float, max_connections: int, tls: Tls | None = None, **options: Any
) -> redis.asyncio.Redis:
    """An asyncio client; `options` (retry, health checks) go to its connections."""
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **options}
    target = sentinel_target(url)
    if target is None:
        pool = BlockingConnectionPool.from_url(
            _with_tls(url, tls),
            max_connections=max_connections,
            timeout=timeout,
            **common,
            **redis_tls(tls),
        )
        return redis.asyncio.Redis(connection_pool=pool)
    sentinel = redis.asyncio.sentinel.Sentinel(
        list(target.sentinels),
        sentinel_kwargs=_sentinel_options(target, timeout, tls),
        password=target.password,
        db=target.db,
        **common,
        **redis_tls(tls),
    )
    return sentinel.master_for(
        target.service,
        connection_pool_class=_BlockingSentinelPool,
        connection_class=_PrimaryConnection if tls is None else _PrimarySSLConnection,
        max_connections=max_connections,
        timeout=timeout,
    )


def sync_client(url: str, timeout: float, tls: Tls | None = None) -> redis.Redis:
    """A blocking client, for the launcher and tools outside an event loop."""
    target = sentinel_target(url)
    if target is None:
        return redis.Redis.from_url(
            _with_tls(url, tls),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **redis_tls(tls),
        )
    sentinel = redis.sentinel.Sentinel(
        list(target.sentinels),
        sentinel_kwargs=_sentinel_options(target, timeout, tls),
        password=target.password,
        db=target.db,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        **redis_tls(tls, flag=True),
    )
    return sentinel.master_for(target.service)  # its reconnects ask the sentinels (test_ha.py)
