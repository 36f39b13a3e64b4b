"""Core-NATS events: per-request outputs, cancel/release broadcasts, plan events, heartbeats.

Core NATS is at-most-once and fast; it fits messages whose loss the system tolerates or repairs
(a lost output shows as a hole or a silence, and the gateway asks its holder to say it again with
a Resend; a lost release is covered by the KV owner's TTL, heartbeats repeat). Tasks, which must
not be lost, use JetStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, FlushTimeoutError, OutboundBufferLimitError

from common.aio import raise_if_cancelled
from common.bus.subjects import Subjects
from common.bus.tasks import DeadLetterSink
from common.protocol import (
    OUTPUT_KINDS,
    Cancel,
    DeadLetter,
    Fence,
    Heartbeat,
    Message,
    Plan,
    PrefixBlocks,
    ProtocolError,
    Release,
    Resend,
    decode,
)

log = logging.getLogger(__name__)
PUBLISH_PATIENCE = 60.0  # seconds a publish waits for NATS to return once the client's buffer is full
SUBSCRIBE_FLUSH_TIMEOUT = 5.0  # seconds a new subscription waits for the server to confirm it


class EventStream:
    """A subscription that yields decoded messages of the expected kinds, in arrival order.

    Malformed messages are logged and dead-lettered (when a sink is given) and never reach the
    reader. Use as `async with` or call `close()`; iteration ends after close.
    """

    def __init__(self, expect: tuple[type[Message], ...], sink: DeadLetterSink | None) -> None:
        self._expect = expect
        self._sink = sink
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._sub: Subscription | None = None
        self.dropped = 0

    def deliver(self, message: Message) -> None:
        """Hand a decoded message to the reader (what arrives on the subscription comes this way)."""
        self._queue.put_nowait(message)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            message = decode(msg.data, expect=self._expect)
        except ProtocolError as exc:
            self.dropped += 1
            log.error("malformed message on %s: %s", msg.subject, exc)
            if self._sink is not None:
                letter = DeadLetter(
                    stream="",
                    subject=msg.subject,
                    stream_seq=0,
                    deliveries=1,
                    reason="malformed",
                    detail=str(exc)[:2000],
                    data=msg.data,
                    time=time.time(),
                )
                try:
                    await self._sink.put_dead_letter(letter)
                except Exception as sink_exc:  # the subscription must outlive a Redis outage
                    log.warning("could not record a dead letter: %r", sink_exc)
            return
        self.deliver(message)

    async def get(self, timeout: float | None = None) -> Message:
        """The next message; raises TimeoutError after `timeout` seconds, EOFError once closed."""
        async with asyncio.timeout(timeout):  # not wait_for, which on 3.11 can drop a cancel
            item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # keep later readers ending too
            raise EOFError("event stream closed")
        return item

    async def __aiter__(self) -> AsyncIterator[Message]:
        while True:
            raise_if_cancelled()  # the reader's last step may have lost a cancel
            try:
                yield await self.get()
            except EOFError:
                return

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # closing during a reconnect must not mask the caller's error
                log.debug("unsubscribe failed: %r", exc)
        self._queue.put_nowait(None)

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class EventBus:
    """Typed publish and subscribe over core NATS."""

    def __init__(self, nc: NATS, subjects: Subjects, sink: DeadLetterSink | None = None) -> None:
        self._nc = nc
        self.subjects = subjects
        self._sink = sink

    async def publish(self, subject: str, message: Message, patience: float = PUBLISH_PATIENCE) -> None:
        """Fire a message; while NATS is away it waits in the client's buffer until the reconnect.
        When that buffer is full (a long outage), wait up to `patience` seconds for NATS to return."""
        data = message.to_bytes()
        deadline = time.monotonic() + patience
        while True:
            try:
                await self._nc.publish(subject, data)
                return
            except OutboundBufferLimitError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def subscribe(
        self, subject: str, expect: tuple[type[Message], ...], queue: str = ""
    ) -> EventStream:
        """Messages on `subject` (wildcards allowed); with `queue`, one member of the group gets each.
        Returns once the server has the subscription, so a message published after this returns is
        not missed (while the broker is away the subscription waits in the client's buffer instead,
        and is made on reconnect)."""
        stream = EventStream(expect, self._sink)
        stream._sub = await self._nc.subscribe(subject, queue=queue, cb=stream._on_msg)
        if self._nc.is_connected:
            with contextlib.suppress(FlushTimeoutError, ConnectionClosedError):
                await self._nc.flush(timeout=SUBSCRIBE_FLUSH_TIMEOUT)
        return stream

    # -- the named events ----------------------------------------------------------------------------
    async def publish_output(self, message: Message) -> None:
        """A TokenDelta, FinalOutput or ErrorOutput, on its request's subject."""
        if not isinstance(message, OUTPUT_KINDS):
            raise TypeError(f"{type(message).__name__} is not an output message")
        await self.publish(self.subjects.output(message.request_id), message)  # type: ignore[attr-defined]

    async def outputs(self, request_id: str) -> EventStream:
        """Subscribe before publishing the request's first task, so no output can be missed."""
        return await self.subscribe(self.subjects.output(request_id), OUTPUT_KINDS)

    async def resend(self, message: Resend) -> None:
        """Ask whoever holds a request (or ended it lately) to say its outputs again."""
        await self.publish(self.subjects.resend, message)

    async def resends(self) -> EventStream:
        return await self.subscribe(self.subjects.resend, (Resend,))

    async def cancel(self, message: Cancel) -> None:
        await self.publish(self.subjects.cancel, message)

    async def cancels(self) -> EventStream:
        return await self.subscribe(self.subjects.cancel, (Cancel,))

    async def fence(self, message: Fence) -> None:
        await self.publish(self.subjects.fence, message)

    async def fences(self) -> EventStream:
        return await self.subscribe(self.subjects.fence, (Fence,))

    async def release(self, message: Release) -> None:
        await self.publish(self.subjects.release(message.owner), message)

    async def releases(self, owner: str) -> EventStream:
        return await self.subscribe(self.subjects.release(owner), (Release,))

    async def plan(self, message: Plan) -> None:
        await self.publish(self.subjects.plan, message)

    async def plans(self) -> EventStream:
        return await self.subscribe(self.subjects.plan, (Plan,))

    async def heartbeat(self, message: Heartbeat) -> None:
        await self.publish(self.subjects.heartbeat(message.instance_id), message)

    async def heartbeats(self) -> EventStream:
        return await self.subscribe(self.subjects.heartbeats_all, (Heartbeat,))

    async def prefix_blocks(self, message: PrefixBlocks) -> None:
        """Prefix-cache keys gained and given up (patience 0: a later snapshot repairs a loss)."""
        await self.publish(self.subjects.prefix_blocks(message.instance_id), message, patience=0.0)

    async def prefix_blocks_all(self) -> EventStream:
        return await self.subscribe(self.subjects.prefix_blocks_all, (PrefixBlocks,))
