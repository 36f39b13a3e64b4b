"""The shared state in Redis: metadata only, never tensors.

    store = await Store.connect(StoreConfig(url=...))
    await store.requests.mark(rid, Stage.PREFILL_STARTED)
    await store.features.put(entry, ttl=600)
    beats = Heartbeater(store.registry, make_heartbeat); beats.start()

Every part survives a Redis restart: the client reconnects on the next command, and what Redis
lost is rewritten by its owner (heartbeats every interval, features on their next encode).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.protocol import DeadLetter
from common.store.connect import async_client, sentinel_target
from common.store.features import FeatureIndex
from common.store.keys import Keys
from common.store.planning import DeadLetters, Planning
from common.store.registry import Heartbeater, Registry
from common.store.requests import RequestLog, RequestRecord, Stage
from common.tls import Tls


@dataclass(frozen=True)
class StoreConfig:
    # A password rides in the URL: redis://:secret@host:port/0, or redis+sentinel://... (connect.py).
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "trident"
    request_ttl: float = 24 * 3600.0
    trace_maxlen: int = 100_000
    # A command waits at most this long; a dead Redis must not stall a service's event loop task.
    socket_timeout: float = 2.0
    retries: int = 3
    failover_retries: int = 12  # with a redis+sentinel:// URL: about 5 s of retries
    # Connections at once; past them a command waits (up to socket_timeout) for a free one instead
    # of failing, as a burst of a thousand requests ending together would otherwise make it.
    max_connections: int = 64
    tls: Tls | None = None  # the deployment's certificates: TLS to Redis (and its sentinels)


class Store:
    """One Redis client and the parts of the schema, each a small object of its own."""

    def __init__(self, redis: Redis, config: StoreConfig) -> None:
        self.redis = redis
        self.config = config
        self.keys = Keys(config.prefix)
        self.requests = RequestLog(redis, self.keys, config.request_ttl, config.trace_maxlen)
        self.registry = Registry(redis, self.keys)
        self.features = FeatureIndex(redis, self.keys)
        self.planning = Planning(redis, self.keys)
        self.dead_letters = DeadLetters(redis, self.keys)

    @classmethod
    async def connect(cls, config: StoreConfig) -> Store:
        """A client that retries a command through a brief outage (e.g. a Redis restart)."""
        # Behind sentinels a command keeps retrying through a failover: the primary is called down
        # after a second of silence and a replica promoted within another few.
        retries = config.retries if sentinel_target(config.url) is None else config.failover_retries
        redis = async_client(
            config.url,
            config.socket_timeout,
            config.max_connections,
            tls=config.tls,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=5,
        )
        try:
            await redis.ping()
        except BaseException:
            await redis.aclose(close_connection_pool=True)
            raise
        return cls(redis, config)

    async def put_dead_letter(self, letter: DeadLetter) -> bool:
        """The bus's dead-letter sink."""
        return await self.dead_letters.put(letter)

    async def close(self) -> None:
        await self.redis.aclose(close_connection_pool=True)


__all__ = [
    "FeatureIndex",
    "Heartbeater",
    "Keys",
    "Planning",
    "Registry",
    "RequestLog",
    "RequestRecord",
    "Stage",
    "Store",
    "StoreConfig",
]
