"""Routing reads the registry at most every `max_age` seconds, however many requests ask, and sees
an instance that comes or goes once that age has passed."""

from __future__ import annotations

import asyncio
import time

from common.protocol import Heartbeat
from common.roles import Role
from common.store import Store, StoreConfig
from services.gateway.routing import LiveRoles


def beat(instance_id: str, roles: tuple[str, ...]) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, roles=roles, time=time.time())  # type: ignore[arg-type]


def test_live_roles_are_read_at_most_every_max_age(redis_server):
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        reads = 0
        original = store.registry.instances

        async def counted():
            nonlocal reads
            reads += 1
            return await original()

        store.registry.instances = counted  # count the reads the real registry answers
        try:
            await store.registry.register(beat("d-1", ("decode",)), ttl=30)
            roles = LiveRoles(store, max_age=0.3)
            answers = await asyncio.gather(*(roles.get() for _ in range(200)))
            assert all(a == {Role.DECODE} for a in answers)
            assert reads == 1  # one read, shared by all who asked meanwhile
            await store.registry.register(beat("p-1", ("prefill",)), ttl=30)
            assert await roles.get() == {Role.DECODE}  # still within max_age
            deadline = time.monotonic() + 5
            while await roles.get() != {Role.DECODE, Role.PREFILL}:
                assert time.monotonic() < deadline, "the new instance was never seen"
                await asyncio.sleep(0.05)
        finally:
            await store.close()

    asyncio.run(main())
