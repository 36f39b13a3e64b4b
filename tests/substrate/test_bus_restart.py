"""NATS restarts under load: publishers and consumers carry on; nothing acked is redone or lost,
and everything unacked comes back."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.bus import Bus, BusConfig
from common.infra import NatsServer
from tests.substrate.helpers import prefill_task, run, take

pytestmark = pytest.mark.timeout(90)


def test_publishers_and_consumers_carry_on_across_a_nats_restart(nats_server: NatsServer) -> None:
    async def main() -> None:
        config = BusConfig(url=nats_server.url, ack_wait=1.0, publish_timeout=20.0)
        producer, worker = await Bus.connect(config), await Bus.connect(config)
        consumer = await worker.consumer("prefill")
        before = [f"a{i}" for i in range(20)]
        for rid in before:
            await producer.tasks.publish(prefill_task(rid))

        acked = [task.message.request.request_id for task in await take(consumer, 10, ack=True)]
        held = await take(consumer, 5, ack=False)  # taken but not acked when NATS goes down
        assert len(acked) == 10 and len(held) == 5

        await asyncio.to_thread(nats_server.stop)
        # A publish while NATS is down waits (retrying) and lands once it is back.
        pending = asyncio.create_task(producer.tasks.publish(prefill_task("during")))
        await asyncio.sleep(1.0)
        assert not pending.done()
        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(pending, 20.0)

        after = [f"b{i}" for i in range(20)]
        for rid in after:
            await producer.tasks.publish(prefill_task(rid))

        expected = {*before, "during", *after} - set(acked)
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while set(seen) != expected and time.monotonic() < deadline:
            for task in await consumer.fetch(8, timeout=1.0):
                rid = task.message.request.request_id
                if await task.ack():
                    seen.append(rid)
        assert set(seen) == expected  # unacked work (the 5 held, the rest) all came back
        assert not set(seen) & set(acked)  # acked work was not redone
        assert producer.connected and worker.connected
        await producer.close()
        await worker.close()

    run(main())
