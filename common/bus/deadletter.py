"""Dead letters for tasks that ran out of deliveries without any worker settling them.

A handler that fails on a task's last delivery dead-letters it itself (`Task.fail`). A task whose
workers all crashed or hung has nobody to do that: JetStream stops redelivering it after
`max_deliver` and publishes a MAX_DELIVERIES advisory. This watcher turns the advisory into a
dead-letter record (with the task's bytes) and removes the task from the work queue, where it
would otherwise stay forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from common.bus.connection import BusConfig
from common.bus.tasks import DeadLetterSink, tell_the_client
from common.protocol import DeadLetter

log = logging.getLogger(__name__)


class DeadLetterWatcher:
    """Listens for MAX_DELIVERIES advisories of the task stream; one member of the queue group
    handles each advisory, and the sink's idempotency covers the rare double."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: BusConfig, sink: DeadLetterSink) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._sink = sink
        self._sub: Subscription | None = None
        self.recorded = 0

    async def start(self) -> None:
        subjects = self._config.subjects
        self._sub = await self._nc.subscribe(
            subjects.max_deliveries_advisory(), queue=f"{subjects.prefix}-deadletter", cb=self._on_advisory
        )

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %r", exc)

    async def _on_advisory(self, msg: Msg) -> None:
        # A failure here must not kill the subscription's callback task: log and keep listening.
        try:
            await self._handle(json.loads(msg.data))
        except Exception:
            log.exception("could not record a dead letter from advisory %r", msg.data[:500])

    async def _handle(self, advisory: dict) -> None:
        stream, seq = advisory["stream"], int(advisory["stream_seq"])
        subject, data = "", b""
        try:
            stored = await self._js.get_msg(stream, seq)
            subject, data = stored.subject or "", stored.data or b""
        except NotFoundError:
            pass  # already settled or removed by another watcher; record what the advisory says
        letter = DeadLetter(
            stream=stream,
            subject=subject,
            stream_seq=seq,
            deliveries=int(advisory.get("deliveries", 0)),
            reason="max_deliver",
            detail="no worker settled the task within its deliveries",
            consumer=advisory.get("consumer", ""),
            data=data,
            time=time.time(),
        )
        if await self._sink.put_dead_letter(letter):
            self.recorded += 1
            log.error("task %s#%d dead-lettered after %d deliveries", stream, seq, letter.deliveries)
            await tell_the_client(self._nc, self._config, letter)
        with contextlib.suppress(NotFoundError):  # another watcher removed it first
            await self._js.delete_msg(stream, seq)
