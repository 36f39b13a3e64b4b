"""The instance registry: heartbeats with a TTL, so a dead instance drops out on its own.

Each instance's record is a key with a TTL; a sorted set (id -> expiry) indexes them so listing
needs no SCAN. A key that expired leaves a stale index entry, which listing prunes by score.
The heartbeat loop rewrites the record every interval, which is also how an instance
re-registers after Redis restarts empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.exceptions
from redis.asyncio import Redis

from common.aio import raise_if_cancelled
from common.protocol import Heartbeat, ProtocolError, decode
from common.store.keys import Keys

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self._r = redis
        self._keys = keys

    async def register(self, heartbeat: Heartbeat, ttl: float) -> None:
        """Write (or refresh) an instance's record; it vanishes `ttl` seconds after the last refresh."""
        expires = time.time() + ttl
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.instance(heartbeat.instance_id), heartbeat.to_bytes(), px=int(ttl * 1000))
            pipe.zadd(self._keys.instances, {heartbeat.instance_id: expires})
            await pipe.execute()

    async def deregister(self, instance_id: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.instance(instance_id))
            pipe.zrem(self._keys.instances, instance_id)
            await pipe.execute()

    async def get(self, instance_id: str) -> Heartbeat | None:
        raw = await self._r.get(self._keys.instance(instance_id))
        return self._decode(raw)

    async def instances(self, role: str | None = None) -> list[Heartbeat]:
        """Live instances (optionally only those with `role`), sorted by id."""
        await self._r.zremrangebyscore(self._keys.instances, "-inf", time.time())
        ids = sorted(i.decode() for i in await self._r.zrange(self._keys.instances, 0, -1))
        if not ids:
            return []
        raws = await self._r.mget([self._keys.instance(i) for i in ids])
        beats = [hb for hb in map(self._decode, raws) if hb is not None]
        return [hb for hb in beats if role is None or role in hb.roles]

    @staticmethod
    def _decode(raw: bytes | None) -> Heartbeat | None:
        if raw is None:
            return None
        try:
            return decode(raw, expect=Heartbeat)
        except ProtocolError as exc:  # a record from a newer build: skip it rather than fail listing
            log.warning("unreadable registry record: %s", exc)
            return None


class Heartbeater:
    """Registers an instance every `interval` seconds until stopped, riding out Redis outages.

    `make` builds the current heartbeat (load figures change); `also` (optional) runs after each
    successful write, e.g. to publish the heartbeat on NATS. `stop()` deregisters, so a drained
    instance leaves the registry at once instead of after its TTL.
    """

    def __init__(
        self,
        registry: Registry,
        make: Callable[[], Heartbeat],
        interval: float = 1.0,
        ttl: float | None = None,
        also: Callable[[Heartbeat], Awaitable[None]] | None = None,
    ) -> None:
        self._registry = registry
        self._make = make
        self.interval = interval
        self.ttl = ttl if ttl is not None else 3 * interval  # two missed beats are tolerated
        self._also = also
        self._task: asyncio.Task[None] | None = None
        self._instance_id: str | None = None
        self.beats = 0
        self.failures = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="heartbeater")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister and self._instance_id is not None:
            try:
                await self._registry.deregister(self._instance_id)
            except redis.exceptions.RedisError as exc:
                log.warning("could not deregister %s: %r (its record will expire)", self._instance_id, exc)

    async def beat(self) -> None:
        """Write one heartbeat now."""
        heartbeat = self._make()
        self._instance_id = heartbeat.instance_id
        await self._registry.register(heartbeat, self.ttl)
        self.beats += 1
        if self._also is not None:
            await self._also(heartbeat)

    async def _run(self) -> None:
        down = False
        while True:
            raise_if_cancelled()
            try:
                await self.beat()
                if down:
                    log.info("registry reachable again; %s re-registered", self._instance_id)
                down = False
            except (redis.exceptions.RedisError, OSError) as exc:
                self.failures += 1
                if not down:  # one line per outage, not one per beat
                    log.warning("heartbeat failed (%r); retrying every %.1fs", exc, self.interval)
                down = True
            await asyncio.sleep(self.interval)
