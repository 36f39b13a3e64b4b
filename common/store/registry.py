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

# KEYS: the record, the index, the fence mark; ARGV: the heartbeat, ttl ms, expiry, id. An
# instance taken for dead cannot register again: a frozen one that wakes beats once before it
# hears of its fence, and that beat must not make it look live to routing.
_REGISTER_UNLESS_FENCED = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return 1
"""


class Registry:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self._r = redis
        self._keys = keys
        self._register = redis.register_script(_REGISTER_UNLESS_FENCED)

    async def register(self, heartbeat: Heartbeat, ttl: float) -> bool:
        """Write (or refresh) an instance's record; it vanishes `ttl` seconds after the last refresh.
        False, and nothing written, if the instance was fenced."""
        instance_id = heartbeat.instance_id
        keys = [self._keys.instance(instance_id), self._keys.instances, self._keys.fenced(instance_id)]
        args = [heartbeat.to_bytes(), int(ttl * 1000), time.time() + ttl, instance_id]
        return bool(await self._register(keys=keys, args=args))

    async def deregister(self, instance_id: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.instance(instance_id))
            pipe.zrem(self._keys.instances, instance_id)
            await pipe.execute()

    async def claim_death(self, instance_id: str, ttl: float = 300.0) -> bool:
        """Take on handing over a dead instance's work; only the first watcher to ask gets True."""
        return bool(await self._r.set(self._keys.reaped(instance_id), 1, nx=True, ex=int(ttl)))

    async def claim_task(self, stream: str, seq: int, msg_id: str, owner: str, ttl: float = 600.0) -> str:
        """Take a task sent to one instance's mailbox: the instance, to run it; its sender, to move
        it to the shared queue after waiting too long; the failover, to hand a dead instance's on.
        Returns who has it: `owner` for the first to ask, the first one's name for the others.

        The task is its stream sequence and its message id (which names the request): a stream
        made again (a new JetStream store under a Redis that kept its keys) numbers from 1 again,
        and a claim on the sequence alone would give its tasks to the old ones' owners."""
        key = self._keys.task_claim(stream, seq, msg_id)
        prior = await self._r.set(key, owner, nx=True, get=True, ex=int(ttl))
        return owner if prior is None else prior.decode()

    async def fence(self, instance_id: str, ttl: float = 86400.0) -> None:
        """Mark an instance found dead and drop its record: should it come back, it must leave."""
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.fenced(instance_id), 1, ex=int(ttl))
            pipe.delete(self._keys.instance(instance_id))
            pipe.zrem(self._keys.instances, instance_id)
            await pipe.execute()

    async def is_fenced(self, instance_id: str) -> bool:
        return bool(await self._r.exists(self._keys.fenced(instance_id)))

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
    """Beats every `interval` seconds until stopped, riding out Redis and NATS outages alike.

    `make` builds the current heartbeat (load figures change). Each beat is published with
    `publish` (NATS: how watchers notice a death within seconds) and, for a worker, written to the
    registry with a TTL; one failing does not stop the other. `poke()` publishes a beat now (a
    worker that took a task says so at once, so its failover can hand the task on). `stop()`
    publishes a last, leaving beat and deregisters, so a drained instance is neither missed nor
    counted as live. With `registry=None` (a gateway) nothing is written to Redis.
    """

    def __init__(
        self,
        registry: Registry | None,
        make: Callable[[], Heartbeat],
        interval: float = 1.0,
        ttl: float | None = None,
        publish: Callable[[Heartbeat], Awaitable[None]] | None = None,
    ) -> None:
        self._registry = registry
        self._make = make
        self.interval = interval
        self.ttl = ttl if ttl is not None else 3 * interval  # two missed beats are tolerated
        self._publish = publish
        self._task: asyncio.Task[None] | None = None
        self._instance_id: str | None = None
        self._poked = asyncio.Event()
        self.beats = 0
        self.refused = False  # the registry refused a beat: this instance was fenced
        self.failures = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="heartbeater")

    def poke(self) -> None:
        """Beat now rather than at the next interval."""
        self._poked.set()

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not deregister:
            return
        if self._publish is not None:
            try:
                await self._publish(self._make().model_copy(update={"leaving": True, "held": ()}))
            except Exception as exc:
                log.warning(
                    "could not say %s is leaving: %r (it will be taken for dead)", self._instance_id, exc
                )
        if self._registry is not None and self._instance_id is not None:
            try:
                await self._registry.deregister(self._instance_id)
            except redis.exceptions.RedisError as exc:
                log.warning("could not deregister %s: %r (its record will expire)", self._instance_id, exc)

    async def beat(self) -> None:
        """Publish one heartbeat now, and write it to the registry."""
        heartbeat = self._make()
        self._instance_id = heartbeat.instance_id
        if self._publish is not None:
            try:
                await self._publish(heartbeat)
            except Exception as exc:  # NATS away: the registry still hears of us
                log.debug("heartbeat not published: %r", exc)
        if self._registry is not None and not await self._registry.register(heartbeat, self.ttl):
            if not self.refused:
                log.warning("the registry refuses %s: it was taken for dead", heartbeat.instance_id)
            self.refused = True
        self.beats += 1

    async def run(self) -> None:
        """Beat until cancelled (`start()` runs it as a task of its own; a service runtime
        supervises it with its other loops)."""
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
            with contextlib.suppress(TimeoutError):  # not wait_for, which on 3.11 can drop a cancel
                async with asyncio.timeout(self.interval):
                    await self._poked.wait()
            self._poked.clear()
