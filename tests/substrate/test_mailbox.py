"""Tasks sent to one instance (routing by cached prefix), against a real nats-server and
redis-server: the instance's mailbox beside the shared queue, the claim that decides between it and
the sender, the sender taking a task back to the shared queue when its target does not take it in
time, and a mailbox task given back going to the shared queue (nobody else reads the mailbox)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from common.bus import Bus, BusConfig
from common.bus.tasks import FAILOVER_HEADER
from common.dispatch import Dispatcher
from common.infra import NatsServer, RedisServer
from common.roles import Role
from common.store import Store, StoreConfig
from common.store.recorder import StageRecorder
from tests.substrate.helpers import prefill_task, run

pytestmark = pytest.mark.timeout(60)
BACK = 0.5  # seconds a sent task waits for its target here


@contextlib.asynccontextmanager
async def sender_and_instance(nats: NatsServer, redis: RedisServer):
    store = await Store.connect(StoreConfig(url=redis.url, prefix="mb"))
    bus = await Bus.connect(BusConfig(url=nats.url, prefix="mb"))
    dispatch = Dispatcher(bus.tasks, StageRecorder(store), bus, store.registry, "gw", take_back_after=BACK)
    backs = asyncio.create_task(dispatch.take_backs())
    try:
        yield dispatch, bus, store
    finally:
        backs.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await backs
        await bus.close()
        await store.close()


async def fetch_all(consumer, want: int, timeout: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += await consumer.fetch(want - len(got), timeout=0.2)
    return got


async def claimed_by_p1(dispatch, bus, store, rid: str):
    """A task for `rid` sent to instance p1, fetched from its mailbox and claimed by it; with p1's
    mailbox and the shared queue's consumers."""
    mailbox, shared = await bus.mailbox(Role.PREFILL, "p1"), await bus.consumer(Role.PREFILL)
    await dispatch.send(prefill_task(rid), "gateway", to="p1")
    [task] = await fetch_all(mailbox, 1)
    claim = await store.registry.claim_task(bus.subjects.task_stream, task.stream_seq, task.msg_id, "p1")
    assert claim == "p1"
    return mailbox, shared, task


def test_a_task_sent_to_an_instance_is_its_own_once_claimed(nats_server, redis_server):
    async def main() -> None:
        async with sender_and_instance(nats_server, redis_server) as (dispatch, bus, store):
            _, shared, task = await claimed_by_p1(dispatch, bus, store, "r1")
            assert task.message.request.request_id == "r1" and not task.redelivered
            await asyncio.sleep(BACK * 3)  # past the take-back: the sender finds it claimed
            assert dispatch.taken_back == 0 and dispatch.waiting == 0
            assert await shared.fetch(1, timeout=0.3) == []
            assert await task.ack()

    run(main())


def test_a_claim_an_earlier_stream_left_on_the_same_sequence_takes_nothing(nats_server, redis_server):
    """A task stream made again (a new JetStream store under a Redis that kept its keys) numbers its
    tasks from 1 again, and claims outlive it (10 min). One left on a sequence by an earlier task
    must not give the new task on that sequence to the earlier one's owner."""

    async def main() -> None:
        async with sender_and_instance(nats_server, redis_server) as (dispatch, bus, store):
            stream = bus.subjects.task_stream
            upcoming = (await bus.js.stream_info(stream)).state.last_seq + 1
            old = "r0:prefill:from-gateway:to-p0"
            assert await store.registry.claim_task(stream, upcoming, old, "p0") == "p0"
            _, _, task = await claimed_by_p1(dispatch, bus, store, "r1")
            assert task.stream_seq == upcoming and task.msg_id != old
            await asyncio.sleep(BACK * 3)  # the sender finds the task claimed by its target
            assert dispatch.taken_back == 0
            assert await task.ack()

    run(main())


def test_a_task_its_target_does_not_take_goes_to_the_shared_queue_in_time(nats_server, redis_server):
    """Nobody reads p9's mailbox (busy, frozen or dead): within the bound, the task is on the
    shared queue, once, and the mailbox is empty; p9 coming back to it later finds it gone."""

    async def main() -> None:
        async with sender_and_instance(nats_server, redis_server) as (dispatch, bus, _):
            shared = await bus.consumer(Role.PREFILL)
            sent = time.monotonic()
            await dispatch.send(prefill_task("r2"), "gateway", to="p9")
            [task] = await fetch_all(shared, 1, timeout=BACK + 5)
            assert BACK <= time.monotonic() - sent < BACK + 2
            assert task.message.request.request_id == "r2"
            async with asyncio.timeout(5):
                while dispatch.taken_back != 1:  # counted once the mailbox copy is deleted
                    await asyncio.sleep(0.01)
            assert await shared.fetch(1, timeout=0.5) == []  # once
            late = await bus.mailbox(Role.PREFILL, "p9")
            assert await late.fetch(1, timeout=0.3) == []
            await task.ack()

    run(main())


def test_a_mailbox_task_given_back_goes_to_the_shared_queue(nats_server, redis_server):
    """A draining instance naks what it took: in its mailbox nobody else would ever see it."""

    async def main() -> None:
        async with sender_and_instance(nats_server, redis_server) as (dispatch, bus, store):
            mailbox, shared, task = await claimed_by_p1(dispatch, bus, store, "r3")
            await task.nak()
            [again] = await fetch_all(shared, 1)
            assert again.message.request.request_id == "r3"
            assert again.redelivered and again.msg.headers[FAILOVER_HEADER] == "p1"
            assert await mailbox.fetch(1, timeout=0.3) == []
            await again.ack()
            await asyncio.sleep(BACK * 2)
            assert dispatch.taken_back == 0  # claimed by p1: the sender leaves it

    run(main())


def test_a_dispatcher_without_the_bus_refuses_to_send_to_one_instance(nats_server, redis_server):
    async def main() -> None:
        async with sender_and_instance(nats_server, redis_server) as (_, bus, store):
            plain = Dispatcher(bus.tasks, StageRecorder(store))
            with pytest.raises(RuntimeError, match="shared queues only"):
                await plain.send(prefill_task("r4"), "gateway", to="p1")

    run(main())
