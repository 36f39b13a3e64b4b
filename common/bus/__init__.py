"""The message bus: stage tasks over JetStream, everything else over core NATS.

bus = await Bus.connect(BusConfig(url=...), dead_letters=store)
await bus.tasks.publish(PrefillTask(...))
consumer = await bus.consumer("prefill")
tasks = await consumer.fetch(max_tasks=free_slots)
keeper = asyncio.create_task(keep_alive(lambda: tasks, config.keep_alive_period))
...                                  # work that may outlast ack_wait
await task.ack()
await bus.close()
"""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS

from common.bus.connection import BusConfig, connect_nats, consumer_config, ensure_task_stream
from common.bus.deadletter import DeadLetterWatcher
from common.bus.events import EventBus, EventStream
from common.bus.subjects import TASK_KINDS, Subjects, check_token
from common.bus.tasks import (
    DeadLetterSink,
    PublishError,
    QueueFull,
    Task,
    TaskConsumer,
    TaskPublisher,
    keep_alive,
)
from common.roles import Role

log = logging.getLogger(__name__)


class Bus:
    """One NATS connection with the task stream declared, a publisher, and consumers on demand."""

    def __init__(self, nc: NATS, config: BusConfig, dead_letters: DeadLetterSink | None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.config = config
        self.subjects = config.subjects
        self.tasks = TaskPublisher(self.js, config)
        self.events = EventBus(nc, self.subjects, dead_letters)
        self._dead_letters = dead_letters
        self._consumers: list[TaskConsumer] = []
        self._watcher: DeadLetterWatcher | None = None
        self.reconnects = 0  # times the connection came back after NATS was away

    @classmethod
    async def connect(cls, config: BusConfig, dead_letters: DeadLetterSink | None = None) -> Bus:
        """Connect, declare the stream and consumers, and (with a sink) watch for dead letters."""
        made: list[Bus] = []

        def reconnected() -> None:
            if made:
                made[0].reconnects += 1

        nc = await connect_nats(config, on_reconnect=reconnected)
        bus = cls(nc, config, dead_letters)
        made.append(bus)
        try:
            await ensure_task_stream(bus.js, config)
            if dead_letters is not None:
                bus._watcher = DeadLetterWatcher(nc, bus.js, config, dead_letters)
                await bus._watcher.start()
        except BaseException:
            await nc.close()
            raise
        return bus

    async def consumer(self, role: Role) -> TaskConsumer:
        """A puller on `role`'s shared durable consumer."""
        consumer = TaskConsumer(self.nc, self.js, self.config, role, self._dead_letters)
        await consumer.start()
        self._consumers.append(consumer)
        return consumer

    async def mailbox(self, role: Role, instance_id: str) -> TaskConsumer:
        """A puller on the tasks sent to `instance_id` alone (routing by cached prefix)."""
        consumer = TaskConsumer(self.nc, self.js, self.config, role, self._dead_letters)
        await consumer.start_mailbox(instance_id)
        self._consumers.append(consumer)
        return consumer

    async def queued(self, role: Role) -> int:
        """Tasks waiting for `role`'s shared consumer (not yet delivered to any puller). Raises
        what nats-py raises while NATS is away."""
        info = await self.js.consumer_info(self.subjects.task_stream, self.subjects.consumer(role))
        return info.num_pending or 0

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    async def close(self) -> None:
        """Unsubscribe, flush what is buffered and disconnect."""
        if self._watcher is not None:
            await self._watcher.close()
        for consumer in self._consumers:
            await consumer.close()
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception as exc:  # draining while NATS is away times out; close regardless
                log.debug("drain failed (%r); closing", exc)
                await self.nc.close()


__all__ = [
    "TASK_KINDS",
    "Bus",
    "BusConfig",
    "DeadLetterSink",
    "DeadLetterWatcher",
    "EventBus",
    "EventStream",
    "PublishError",
    "QueueFull",
    "Subjects",
    "Task",
    "TaskConsumer",
    "TaskPublisher",
    "check_token",
    "connect_nats",
    "consumer_config",
    "ensure_task_stream",
    "keep_alive",
]
