"""Stage profiles, the planner's current plan, and dead-letter records."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from redis.asyncio import Redis

from common.protocol import DeadLetter, Method, Plan, ProtocolError, StageProfile, StepStats, decode
from common.store.keys import Keys

log = logging.getLogger(__name__)

_SEEN_TTL = 7 * 24 * 3600
STEPS_MAX_AGE = 60.0  # seconds: step stats older than this are from an instance that is gone


class Planning:
    """Profiles instances publish, and the plan the planner writes with a rising decision id."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self._r = redis
        self._keys = keys

    async def put_profile(self, profile: StageProfile) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.profile(profile.profile_id), profile.to_bytes())
            pipe.sadd(self._keys.profiles, profile.profile_id)
            await pipe.execute()

    async def get_profile(self, profile_id: str) -> StageProfile | None:
        raw = await self._r.get(self._keys.profile(profile_id))
        return None if raw is None else decode(raw, expect=StageProfile)

    async def claim_profile(self, profile_id: str, owner: str, ttl: float) -> bool:
        """Whether `owner` may measure this profile now: it took the claim, or already held it (and
        the claim is renewed). Instances with the same fingerprint measure once; the others wait for
        `get_profile`. A claim whose owner died lapses after `ttl` seconds."""
        key = self._keys.profile_claim(profile_id)
        if await self._r.set(key, owner, nx=True, ex=max(1, int(ttl))):
            return True
        if await self._r.get(key) == owner.encode():
            await self._r.expire(key, max(1, int(ttl)))
            return True
        return False

    async def release_profile_claim(self, profile_id: str) -> None:
        await self._r.delete(self._keys.profile_claim(profile_id))

    async def profiles(self) -> list[StageProfile]:
        ids = sorted(i.decode() for i in await self._r.smembers(self._keys.profiles))
        found = [await self.get_profile(i) for i in ids]
        return [p for p in found if p is not None]

    async def put_steps(self, stats: StepStats) -> None:
        await self._r.hset(self._keys.steps, stats.instance_id, stats.to_bytes())

    async def steps(self, max_age: float = STEPS_MAX_AGE) -> list[StepStats]:
        """Every instance's latest StepStats no older than `max_age` seconds; older ones (their
        instance is gone) are dropped from Redis as they are found."""
        found, stale = [], []
        now = time.time()
        for instance, raw in (await self._r.hgetall(self._keys.steps)).items():
            try:
                stats = decode(raw, expect=StepStats)
            except ProtocolError as exc:
                log.warning("unreadable step stats of %s: %s", instance, exc)
                continue
            (found if now - stats.time <= max_age else stale).append(stats)
        if stale:
            await self._r.hdel(self._keys.steps, *[s.instance_id for s in stale])
        return sorted(found, key=lambda s: s.instance_id)

    async def put_plan(
        self, method: Method, replicas: Mapping[str, int], goodput: float | None = None, reason: str = ""
    ) -> Plan:
        """Store a new current plan under the next decision id and return it (publish it on NATS too)."""
        decision_id = await self._r.incr(self._keys.plan_seq)
        plan = Plan(
            decision_id=decision_id,
            method=method,
            replicas=dict(replicas),
            time=time.time(),
            goodput=goodput,
            reason=reason,
        )
        await self._r.set(self._keys.plan, plan.to_bytes())
        return plan

    async def current_plan(self) -> Plan | None:
        raw = await self._r.get(self._keys.plan)
        return None if raw is None else decode(raw, expect=Plan)


class DeadLetters:
    """Dead-letter records in a capped stream, at most one per task (by stream sequence)."""

    def __init__(self, redis: Redis, keys: Keys, maxlen: int = 10_000) -> None:
        self._r = redis
        self._keys = keys
        self._maxlen = maxlen

    async def put(self, letter: DeadLetter) -> bool:
        """Append a record; False if this task was already recorded (two watchers, or a retry)."""
        if letter.stream and letter.stream_seq:
            seen = self._keys.dead_letter_seen(letter.stream, letter.stream_seq)
            if not await self._r.set(seen, b"1", nx=True, ex=_SEEN_TTL):
                return False
        await self._r.xadd(
            self._keys.dead_letters, {"d": letter.to_bytes()}, maxlen=self._maxlen, approximate=True
        )
        return True

    async def list(self, count: int = 100) -> list[DeadLetter]:
        """The most recent records, oldest first."""
        rows = await self._r.xrevrange(self._keys.dead_letters, count=count)
        letters = []
        for _, fields in reversed(rows):
            try:
                letters.append(decode(fields[b"d"], expect=DeadLetter))
            except ProtocolError as exc:
                log.warning("unreadable dead letter: %s", exc)
        return letters
