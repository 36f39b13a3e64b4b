"""The task bus against a real nats-server: competing consumers, redelivery, dead letters, keep-alive."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from common.bus import Bus, BusConfig, keep_alive
from common.infra import NatsServer, RedisServer
from common.protocol import Cancel, ErrorOutput, FinalOutput, PrefillTask, TokenDelta, Usage, decode
from common.store import Store, StoreConfig
from tests.substrate.helpers import eventually, fetch_and_hang, prefill_task, run, spawn

pytestmark = pytest.mark.timeout(60)


def _config(nats: NatsServer, **kw: float) -> BusConfig:
    return BusConfig(url=nats.url, **kw)  # type: ignore[arg-type]


def _ids(tasks: list) -> list[str]:
    return [t.message.request.request_id for t in tasks]


def test_each_task_goes_to_exactly_one_of_two_competing_consumers(nats_server: NatsServer) -> None:
    async def main() -> None:
        config = _config(nats_server)
        a, b = await Bus.connect(config), await Bus.connect(config)  # two replicas, two connections
        ca, cb = await a.consumer("prefill"), await b.consumer("prefill")
        ids = [f"r{i}" for i in range(40)]
        for rid in ids:
            await a.tasks.publish(prefill_task(rid))
        got: dict[str, list[str]] = {"a": [], "b": []}

        async def drain(name: str, consumer) -> None:
            while True:
                tasks = await consumer.fetch(3, timeout=0.5)  # as much as a small batcher has room for
                if not tasks:
                    return
                got[name] += _ids(tasks)
                for t in tasks:
                    await t.ack()
                await asyncio.sleep(0.01)

        await asyncio.gather(drain("a", ca), drain("b", cb))
        assert sorted(got["a"] + got["b"]) == sorted(ids)  # every task delivered...
        assert not set(got["a"]) & set(got["b"])  # ...to exactly one consumer
        assert got["a"] and got["b"]  # and both replicas took a share
        await a.close()
        await b.close()

    run(main())


def test_a_consumer_takes_no_more_than_it_asks_for(nats_server: NatsServer) -> None:
    async def main() -> None:
        bus = await Bus.connect(_config(nats_server))
        consumer = await bus.consumer("decode")
        other = await bus.consumer("prefill")
        for i in range(5):
            await bus.tasks.publish(prefill_task(f"r{i}"))
        assert await consumer.fetch(5, timeout=0.3) == []  # another role's tasks are not ours
        # Never more than asked for. (The tasks queued behind the first come with it when they
        # arrive within a few ms; on a loaded machine they may come with the next fetch instead.)
        first = await other.fetch(2, timeout=1.0)
        assert 1 <= len(first) <= 2
        rest: list = []
        for _ in range(10):
            if len(first) + len(rest) == 5:
                break
            rest += await other.fetch(10, timeout=1.0)
        assert len(first) + len(rest) == 5
        for t in first + rest:
            await t.ack()
        await bus.close()

    run(main())


def test_task_of_a_killed_consumer_is_redelivered_to_the_other(nats_server: NatsServer) -> None:
    config = _config(nats_server, ack_wait=1.0)

    async def main() -> None:
        bus = await Bus.connect(config)
        await bus.tasks.publish(prefill_task("victim"))
        proc, conn = await asyncio.to_thread(spawn, fetch_and_hang, config, "prefill")
        try:
            assert await asyncio.to_thread(conn.poll, 30), "worker process took nothing"
            assert await asyncio.to_thread(conn.recv) == "victim"
            os.kill(proc.pid, signal.SIGKILL)  # dies holding the task, unacked
            await asyncio.to_thread(proc.join, 10)
            survivor = await bus.consumer("prefill")
            tasks = []
            deadline = time.monotonic() + 10
            while not tasks and time.monotonic() < deadline:
                tasks = await survivor.fetch(1, timeout=1.0)
            assert _ids(tasks) == ["victim"]
            assert tasks[0].deliveries == 2
            assert await tasks[0].ack()
            assert await survivor.fetch(1, timeout=1.5) == []  # acked: gone for good
        finally:
            if proc.is_alive():
                proc.kill()
        await bus.close()

    run(main())


def test_keep_alive_holds_a_long_task_past_ack_wait(nats_server: NatsServer) -> None:
    async def main() -> None:
        config = _config(nats_server, ack_wait=0.6)
        worker, rival = await Bus.connect(config), await Bus.connect(config)
        cw, cr = await worker.consumer("prefill"), await rival.consumer("prefill")
        await worker.tasks.publish(prefill_task("long"))
        (task,) = await cw.fetch(1, timeout=2.0)
        beats = asyncio.create_task(keep_alive(lambda: [task], period=0.2))
        stolen = await cr.fetch(1, timeout=2.0)  # three ack_waits of work
        beats.cancel()
        assert stolen == []
        assert await task.ack()
        await worker.close()
        await rival.close()

    run(main())


def test_max_deliver_ends_in_a_dead_letter(nats_server: NatsServer, redis_server: RedisServer) -> None:
    """Both ways a task runs out of deliveries: its handler keeps failing, or nobody ever settles it."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        bus = await Bus.connect(
            _config(nats_server, ack_wait=0.5, max_deliver=2, nak_delay=0.1), dead_letters=store
        )
        consumer = await bus.consumer("prefill")
        told = {rid: await bus.events.outputs(rid) for rid in ("poison", "orphan")}
        await bus.tasks.publish(prefill_task("poison"))
        for attempt in (1, 2):
            tasks = await consumer.fetch(1, timeout=3.0)
            assert _ids(tasks) == ["poison"] and tasks[0].deliveries == attempt
            await tasks[0].fail("handler raised ValueError")
        await bus.tasks.publish(prefill_task("orphan"))
        for _ in (1, 2):  # fetched and dropped on the floor, as by a hung worker
            assert _ids(await consumer.fetch(1, timeout=3.0)) == ["orphan"]

        async def two_letters() -> bool:
            # JetStream notices the exhausted task when it next serves a pull, as a live worker makes.
            assert await consumer.fetch(1, timeout=0.2) == []
            return len(await store.dead_letters.list()) == 2

        assert await eventually(two_letters, timeout=5.0)
        failed, lost = await store.dead_letters.list()
        assert (failed.reason, failed.deliveries, failed.detail) == ("failed", 2, "handler raised ValueError")
        assert lost.reason == "max_deliver" and lost.deliveries == 2
        assert decode(lost.data, expect=PrefillTask).request.request_id == "orphan"

        async def queue_empty() -> bool:
            # The watcher records the letter, tells the client, then removes the task: a moment after.
            return (await bus.js.stream_info(bus.subjects.task_stream)).state.messages == 0

        assert await eventually(queue_empty, timeout=5.0)  # neither is left clogging the work queue
        # Each client is told its request was given up, rather than left to wait out its deadline.
        poison, orphan = [await told[rid].get(timeout=5) for rid in ("poison", "orphan")]
        assert isinstance(poison, ErrorOutput) and "failed 2 times" in poison.message
        assert isinstance(orphan, ErrorOutput) and "no prefill instance finished it" in orphan.message
        await bus.close()
        await store.close()

    run(main())


def test_malformed_task_is_dead_lettered_and_the_consumer_carries_on(
    nats_server: NatsServer, redis_server: RedisServer
) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        bus = await Bus.connect(_config(nats_server), dead_letters=store)
        consumer = await bus.consumer("prefill")
        await bus.js.publish(bus.subjects.task("prefill"), b"\x93not a task")
        await bus.js.publish(
            bus.subjects.task("prefill"), TokenDelta(request_id="r", index=0, token_ids=(1,)).to_bytes()
        )
        await bus.tasks.publish(prefill_task("good"))
        got = []
        for _ in range(3):
            got += await consumer.fetch(3, timeout=0.5)
        assert _ids(got) == ["good"]
        letters = await store.dead_letters.list()
        assert [d.reason for d in letters] == ["malformed", "malformed"]
        assert letters[0].data == b"\x93not a task"
        await bus.close()
        await store.close()

    run(main())


def test_outputs_and_broadcasts_are_typed_and_survive_garbage(nats_server: NatsServer) -> None:
    async def main() -> None:
        bus = await Bus.connect(_config(nats_server))
        outputs = await bus.events.outputs("req-1")
        cancels = [await bus.events.cancels(), await bus.events.cancels()]  # two instances listening
        await bus.events.publish_output(TokenDelta(request_id="req-1", index=0, token_ids=(5,)))
        await bus.nc.publish(bus.subjects.output("req-1"), b"garbage")
        final = FinalOutput(
            request_id="req-1",
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=1),
            num_outputs=1,
        )
        await bus.events.publish_output(final)
        await bus.events.cancel(Cancel(request_id="req-1"))
        first = await outputs.get(timeout=2)
        assert isinstance(first, TokenDelta) and first.token_ids == (5,)
        assert await outputs.get(timeout=2) == final
        assert outputs.dropped == 1
        for stream in cancels:
            assert await stream.get(timeout=2) == Cancel(request_id="req-1")
        await outputs.close()
        with pytest.raises(EOFError):
            await outputs.get(timeout=1)
        await bus.close()

    run(main())
