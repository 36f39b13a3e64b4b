"""Stage tasks over JetStream: publish with retries, pull only what there is capacity for, ack explicitly.

Delivery is at-least-once. A worker acks a task only after its effects are durable (the next
stage's task is stored), so a crash at any point redelivers the task, and a stage must treat a
repeated task as harmless (request ids make that possible).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import NoReturn, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError

from common.aio import raise_if_cancelled
from common.bus.connection import BusConfig, mailbox_config
from common.bus.subjects import TASK_KINDS
from common.protocol import DeadLetter, ErrorOutput, ProtocolError, StageTask, decode
from common.roles import Role

log = logging.getLogger(__name__)
FAILOVER_HEADER = "Trident-Failover"  # on a task handed on from a dead instance: which one
MSG_ID_HEADER = "Nats-Msg-Id"  # the id a task was published with: JetStream drops a second copy


def published_id(headers: dict[str, str] | None) -> str:
    """The id a stored or delivered task was published with (it names the request), from its headers."""
    return (headers or {}).get(MSG_ID_HEADER, "")


# Errors that mean "NATS is not there right now"; a publish retries through them until its deadline.
_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)
# How long a fetch waits for queued tasks once it has one, in case another replica took them
# between the count and the fetch: long enough for the server to answer with what is queued.
_QUEUED_WAIT = 0.002


class DeadLetterSink(Protocol):
    """Where dead letters go (the Redis store implements it). Returns False for a duplicate record."""

    async def put_dead_letter(self, letter: DeadLetter) -> bool: ...


class PublishError(RuntimeError):
    """JetStream did not store a task before the publish deadline."""


class QueueFull(PublishError):
    """The stage's queue holds as many tasks as the stream allows (BusConfig.max_queued_tasks)."""


class TaskPublisher:
    """Publishes stage tasks; the subject follows from the task's kind."""

    def __init__(self, js: JetStreamContext, config: BusConfig) -> None:
        self._js = js
        self._config = config

    async def publish(self, task: StageTask, msg_id: str | None = None) -> int:
        """Store a task in the stream and return its stream sequence.

        Retries through a NATS restart until `publish_timeout`. Every attempt carries the same
        message id, so JetStream drops the copy when an attempt was stored but its ack was lost.
        Pass a `msg_id` of your own (e.g. "<request id>:prefill") to also drop the copy a
        redelivered upstream task would publish again.
        """
        if not isinstance(task, StageTask):
            raise TypeError(f"{type(task).__name__} is not a stage task")
        return await self.restore(self._config.subjects.task(task.ROLE), task.to_bytes(), msg_id)

    async def restore(
        self, subject: str, data: bytes, msg_id: str | None = None, headers: dict[str, str] | None = None
    ) -> int:
        """Store an encoded task (the failover hands a dead instance's stored ones on this way)."""
        headers = {**(headers or {}), MSG_ID_HEADER: msg_id or uuid.uuid4().hex}
        deadline = time.monotonic() + self._config.publish_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                ack = await self._js.publish(
                    subject, data, timeout=max(0.1, min(2.0, remaining)), headers=headers
                )
                return ack.seq
            except _TRANSIENT as exc:
                if remaining <= 0:
                    raise PublishError(
                        f"task on {subject} not stored within {self._config.publish_timeout}s"
                    ) from exc
                log.debug("publish to %s not acknowledged yet (%r); retrying", subject, exc)
                await asyncio.sleep(min(0.2, max(0.0, remaining)))
            except nats.js.errors.APIError as exc:
                if "maximum messages" in str(exc.description or ""):
                    full = f"the queue on {subject} is full ({self._config.max_queued_tasks} tasks)"
                    raise QueueFull(full) from exc
                raise


class Task:
    """One delivered task: the decoded message and the means to settle it.

    Settle every task exactly once: `ack()` when done, `fail()` when the handler failed, `nak()`
    to hand it back untouched (e.g. no room after all). Work that outlasts ack_wait is kept
    alive with `in_progress()` (see `keep_alive`).
    """

    def __init__(self, msg: Msg, message: StageTask, consumer: TaskConsumer) -> None:
        self.msg = msg
        self.message = message
        self._consumer = consumer
        self.settled = False

    @property
    def deliveries(self) -> int:
        """How many times this task has been delivered, this time included."""
        return self.msg.metadata.num_delivered

    @property
    def redelivered(self) -> bool:
        """An instance had this task before: delivered again, or handed on from a dead instance
        (common/failover.py). Its request may have streamed tokens since the task was made."""
        return self.deliveries > 1 or FAILOVER_HEADER in (self.msg.headers or {})

    @property
    def stored(self) -> datetime | None:
        """When the broker stored the task (its clock); None if the message does not say."""
        try:
            return self.msg.metadata.timestamp
        except Exception:  # not a JetStream message (its reply subject carries the metadata)
            return None

    @property
    def stream_seq(self) -> int:
        return self.msg.metadata.sequence.stream

    @property
    def msg_id(self) -> str:
        """The id it was published with (deduplication's), which names its request."""
        return published_id(self.msg.headers)

    @property
    def last_attempt(self) -> bool:
        """No redelivery follows this one: a failure now dead-letters the task."""
        return self.deliveries >= self._consumer.config.max_deliver

    async def ack(self, timeout: float = 5.0) -> bool:
        """Done: JetStream removes the task. Waits for the server to confirm and returns False when
        it did not (NATS restarting): the task will then be redelivered and done again, which
        at-least-once delivery allows, so the caller only logs it."""
        self.settled = True
        try:
            await self.msg.ack_sync(timeout=timeout)
            return True
        except nats.errors.Error as exc:
            log.warning("ack of task %d not confirmed (%r); it may be redelivered", self.stream_seq, exc)
            return False

    async def nak(self, delay: float | None = None) -> None:
        """Give the task back for another worker (after `delay` seconds); counts as a delivery. A
        task from this instance's mailbox goes to the shared queue instead: nobody else reads the
        mailbox."""
        if self._consumer.mailbox_of is not None:
            await self._consumer.move_to_shared(self.msg)
        else:
            await self.msg.nak(delay=delay)
        self.settled = True

    async def fail(self, reason: str) -> None:
        """The handler failed: retry after `nak_delay`, or dead-letter it on its last delivery.

        If the dead letter cannot be written, the task is nak'ed instead: out of deliveries, it
        then reaches the MAX_DELIVERIES watcher, which records it.
        """
        self.settled = True
        if self.last_attempt and await self._consumer.try_dead_letter(self.msg, "failed", reason):
            await self.msg.term()
        else:
            await self.msg.nak(delay=self._consumer.config.nak_delay)

    async def in_progress(self) -> None:
        """Push the redelivery deadline back by ack_wait; a missed beat is logged, not raised (a NATS
        restart may drop one, and the next beat comes a third of ack_wait later)."""
        try:
            await self.msg.in_progress()
        except Exception as exc:
            log.warning("in-progress ack for task %d failed: %r", self.stream_seq, exc)


async def tell_the_client(nc: NATS, config: BusConfig, letter: DeadLetter) -> None:
    """A dead-lettered task will never run: its request's client is told why at once, instead of
    waiting out its deadline. A malformed task names no request; nobody can be told."""
    try:
        task = decode(letter.data, expect=tuple(TASK_KINDS.values()))
    except ProtocolError:
        return
    rid, role = task.request.request_id, task.ROLE
    if letter.reason == "failed":
        why = f"its {role} step failed {letter.deliveries} times ({letter.detail[:300]})"
    else:
        why = f"no {role} instance finished it in {letter.deliveries} tries"
    error = ErrorOutput(request_id=rid, code="server_error", message=f"the request was given up: {why}")
    try:
        await nc.publish(config.subjects.output(rid), error.to_bytes())
    except Exception as exc:
        log.warning("could not tell %s's client that it was given up: %r", rid, exc)


async def keep_alive(tasks: Callable[[], Iterable[Task]], period: float) -> NoReturn:
    """Mark every unsettled task `tasks()` names in progress every `period` seconds, for as long as
    this runs: one loop for all the tasks a worker holds, however long their requests take."""
    while True:
        raise_if_cancelled()
        await asyncio.sleep(period)
        for task in list(tasks()):
            if not task.settled:
                await task.in_progress()


class TaskConsumer:
    """One role's side of the durable pull consumer that all its replicas share."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        config: BusConfig,
        role: Role,
        dead_letters: DeadLetterSink | None,
    ) -> None:
        self._nc = nc
        self._js = js
        self.config = config
        self.role = Role(role)
        self._kind = TASK_KINDS[self.role]
        self._sink = dead_letters
        self._sub: JetStreamContext.PullSubscription | None = None
        self.mailbox_of: str | None = None  # the instance whose mailbox this reads, if it reads one

    async def start(self) -> None:
        subjects = self.config.subjects
        self._sub = await self._js.pull_subscribe_bind(
            durable=subjects.consumer(self.role), stream=subjects.task_stream
        )

    async def start_mailbox(self, instance_id: str) -> None:
        """Read the tasks sent to `instance_id` (subjects.mailbox) instead of the shared queue."""
        subjects = self.config.subjects
        self.mailbox_of = instance_id
        await self._js.add_consumer(subjects.task_stream, mailbox_config(self.config, self.role, instance_id))
        self._sub = await self._js.pull_subscribe_bind(
            durable=subjects.mailbox_consumer(self.role, instance_id), stream=subjects.task_stream
        )

    async def move_to_shared(self, msg: Msg) -> None:
        """Store a mailbox task again on the shared queue, marked as handed on by this instance
        (its next holder resumes it from what its client has), then settle the mailbox copy."""
        subject = self.config.subjects.shared(msg.subject)
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        headers[FAILOVER_HEADER] = self.mailbox_of or ""
        seq = msg.metadata.sequence.stream
        await TaskPublisher(self._js, self.config).restore(subject, msg.data, f"moved:{seq}", headers)
        await msg.ack_sync()

    async def fetch(self, max_tasks: int, timeout: float = 1.0) -> list[Task]:
        """Up to `max_tasks` tasks, waiting at most `timeout` for the first. Ask only for what there is
        capacity for: that is what balances load across replicas and pushes back on producers.

        Returns [] on timeout or while NATS is away. Malformed tasks are dead-lettered, not returned.
        """
        if max_tasks < 1 or self._sub is None:
            return []
        # One task, as soon as there is one; then as many more as were queued behind it. (A
        # single fetch of `max_tasks` would hold the first task until the batch fills or the
        # timeout passes. So would a second fetch that finds nothing: the server keeps the pull
        # request open until it expires, which put ~2.7 ms on every lone task's hop. A delivered
        # message's metadata says how many were pending behind it, at no cost.)
        try:
            raw = await self._sub.fetch(batch=1, timeout=timeout)
            queued = raw[0].metadata.num_pending if raw else 0
            if max_tasks > 1 and queued:
                # Any failure here leaves the first task to be returned; the rest stay queued.
                # Another replica may take some first: then this waits out _QUEUED_WAIT.
                with contextlib.suppress(TimeoutError, nats.errors.Error):
                    raw += await self._sub.fetch(batch=min(queued, max_tasks - 1), timeout=_QUEUED_WAIT)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except nats.errors.Error as exc:  # NATS away or restarting (closed, reconnecting, 409 status, ...)
            log.debug("fetch for %s failed (%r); retrying later", self.role, exc)
            await asyncio.sleep(min(timeout, 0.2))  # do not spin while NATS is away
            return []
        tasks = []
        for msg in raw:
            try:
                tasks.append(Task(msg, decode(msg.data, expect=self._kind), self))
            except ProtocolError as exc:
                log.error("malformed %s task (seq %d): %s", self.role, msg.metadata.sequence.stream, exc)
                # Unrecorded, it stays unacked and comes back to be recorded on a later delivery.
                if await self.try_dead_letter(msg, "malformed", str(exc)):
                    await msg.term()
        return tasks

    async def try_dead_letter(self, msg: Msg, reason: str, detail: str) -> bool:
        """`dead_letter`, returning False (logged) instead of raising when the sink is unavailable."""
        try:
            await self.dead_letter(msg, reason, detail)
            return True
        except Exception as exc:  # Redis down: the caller leaves the task to be redelivered
            log.warning("could not record a dead letter (%r); the task will come back", exc)
            return False

    async def dead_letter(self, msg: Msg, reason: str, detail: str) -> None:
        """Record a task that will not be processed (idempotent per stream sequence)."""
        meta = msg.metadata
        letter = DeadLetter(
            stream=meta.stream,
            subject=msg.subject,
            stream_seq=meta.sequence.stream,
            deliveries=meta.num_delivered,
            reason=reason,
            detail=detail[:2000],
            consumer=meta.consumer or "",
            data=msg.data,
            time=time.time(),
        )
        if self._sink is None:
            log.error("dead letter with no sink: %s", letter.model_dump(exclude={"data"}))
        else:
            await self._sink.put_dead_letter(letter)
        await tell_the_client(self._nc, self.config, letter)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
