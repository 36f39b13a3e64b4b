"""Queueing a request's next stage, the one way every service does it: mark the stage queued in
the request's record, then store the task in JetStream under a de-duplication id.

The id names the request, the stage and the step that sends it (`source`: the gateway, or the
stream sequence of the task being handed on). A retry of that very step (after a NATS restart,
say) is stored once; a later step of the same request — a second prefill after its KV was lost —
has another source and is not mistaken for a duplicate.

A task may be sent to one instance (`to`: the one that holds the request's prefix in its cache):
it goes to that instance's mailbox, beside the shared queue. Whoever takes it first claims it in
Redis: the instance, to run it, or — `take_back_after` seconds on, if the instance has not (busy,
slow, or dead) — the sender, who moves it to the shared queue (`take_backs`, a loop the sender's
runtime supervises). So a targeted task waits at most that long for its target.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.js.errors import NotFoundError

from common.bus import TaskPublisher
from common.protocol import StageTask
from common.roles import Role
from common.store import Stage
from common.store.recorder import StageRecorder

log = logging.getLogger(__name__)
QUEUED = {
    Role.ENCODE: Stage.ENCODE_QUEUED,
    Role.PREFILL: Stage.PREFILL_QUEUED,
    Role.DECODE: Stage.DECODE_QUEUED,
}
TAKE_BACK_AFTER = 1.0  # seconds a task sent to one instance waits for it before going to the queue
CLAIM_RETRY = 0.5  # seconds before a take-back that could not reach Redis tries again


@dataclass(order=True)
class _Sent:
    due: float
    seq: int
    msg_id: str = field(compare=False)
    target: str = field(compare=False)

    @property
    def mailbox_msg_id(self) -> str:
        """The id the task went to its target's mailbox with."""
        return f"{self.msg_id}:to-{self.target}"


class Dispatcher:
    def __init__(
        self,
        tasks: TaskPublisher,
        record: StageRecorder,
        bus=None,
        registry=None,
        sender: str = "",
        take_back_after: float = TAKE_BACK_AFTER,
        on_take_back: Callable[[str], None] = lambda target: None,
    ) -> None:
        self.tasks = tasks
        self.record = record
        self._bus = bus  # targeted sends need the bus (mailboxes) and the registry (claims)
        self._registry = registry
        self.sender = sender
        self.take_back_after = take_back_after
        self.on_take_back = on_take_back
        self._sent: list[_Sent] = []  # targeted tasks not yet known taken, soonest due first
        self._wake = asyncio.Event()
        self.taken_back = 0

    async def send(self, task: StageTask, source: str | int, to: str | None = None) -> None:
        """Queue `task` for its stage; `source` names the step that sends it (see the module doc);
        `to`, the instance it is sent to (its mailbox) instead of the shared queue."""
        rid = task.request.request_id
        self.record.mark(rid, QUEUED[task.ROLE])
        msg_id = f"{rid}:{task.ROLE}:from-{source}"
        if to is None:
            await self.tasks.publish(task, msg_id=msg_id)
            return
        if self._bus is None or self._registry is None:
            raise RuntimeError("this dispatcher sends to the shared queues only")
        subject = self._bus.subjects.mailbox(task.ROLE, to)
        sent = _Sent(time.monotonic() + self.take_back_after, 0, msg_id, to)
        sent.seq = await self.tasks.restore(subject, task.to_bytes(), sent.mailbox_msg_id)
        heapq.heappush(self._sent, sent)
        self._wake.set()

    @property
    def waiting(self) -> int:
        """Targeted tasks whose target has not been seen to take them yet."""
        return len(self._sent)

    async def take_backs(self) -> None:
        """Move each targeted task its target has not taken in time to the shared queue, until
        cancelled (the sender's runtime supervises it)."""
        while True:
            if not self._sent:
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = self._sent[0].due - time.monotonic()
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            sent = heapq.heappop(self._sent)
            try:
                await self._take_back(sent)
            except Exception as exc:  # Redis or NATS away: try again shortly
                log.warning("taking back task %d from %s failed (%r); retrying", sent.seq, sent.target, exc)
                sent.due = time.monotonic() + CLAIM_RETRY
                heapq.heappush(self._sent, sent)

    async def _take_back(self, sent: _Sent) -> None:
        bus, stream = self._bus, self._bus.subjects.task_stream
        me = f"sender:{self.sender}"
        if await self._registry.claim_task(stream, sent.seq, sent.mailbox_msg_id, me) != me:
            return  # its target (or the failover) has it
        try:
            stored = await bus.js.get_msg(stream, sent.seq)
        except NotFoundError:
            return  # settled meanwhile
        await self.tasks.restore(bus.subjects.shared(stored.subject), stored.data, sent.msg_id)
        with contextlib.suppress(NotFoundError):
            await bus.js.delete_msg(stream, sent.seq)
        self.taken_back += 1
        self.on_take_back(sent.target)
