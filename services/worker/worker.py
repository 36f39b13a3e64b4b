"""A stage worker's intake and drain: it pulls tasks for its roles only when the engine has room,
gives each to its role's handler, and on SIGTERM stops pulling and finishes what it holds. The
rest of a worker (the engine, outputs, upkeep, heartbeats) is built around it in instance.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from common.aio import raise_if_cancelled
from common.bus import Task
from common.roles import Role
from services.worker.context import StageContext
from services.worker.ledger import AlreadyHeld, Cancelled
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
NO_ROOM_WAIT = 0.02  # seconds a pull loop waits for room in the engine
DRAIN_POLL = 0.1  # seconds between looks at what a drain still waits for
STAGE_HANDOVER = 10.0  # seconds a request's next stage waits for its earlier one here to let go


class StageWorker:
    def __init__(
        self,
        ctx: StageContext,
        handlers: Mapping[Role, StageHandler],
        fenced_gateways: set[str],
        poke: Callable[[], None],
        drain_timeout: float,
    ) -> None:
        self.ctx = ctx
        self.handlers = handlers
        self.fenced_gateways = fenced_gateways  # the failover watch's: their requests are dropped
        self.poke = poke  # a heartbeat now: the failover must know of every task taken
        self.drain_timeout = drain_timeout
        self._drain_deadline = float("inf")
        self._fetched: set[Task] = set()  # pulled, waiting their turn to be handled (not yet held)
        self._fetching = 0  # pulls under way: what they bring must be handed back, not dropped

    # -- what others read --------------------------------------------------------------------------

    def tasks(self) -> list[Task]:
        """Every task this instance has and has not settled: held, or pulled and waiting."""
        held = self.ctx.ledger.tasks()
        return held + [t for t in self._fetched if not t.settled and t not in held]

    def room(self, handler: StageHandler) -> int:
        """How many of `handler`'s tasks to ask for now: none while draining or fenced, else what
        its stage's rule says the batcher can take soon."""
        if self.ctx.draining.is_set() or self.ctx.fenced.is_set():
            return 0
        return handler.room(self.ctx.engine.stats.load())

    # -- intake ------------------------------------------------------------------------------------

    async def pull(self, handler: StageHandler, mailbox: bool = False) -> None:
        """Pull `handler`'s role's tasks while there is room, until cancelled: from the role's shared
        queue, or (`mailbox`) from those sent to this instance alone, each claimed before it is
        taken (common/dispatch.py: its sender takes back what waits too long)."""
        bus, me = self.ctx.bus, self.ctx.instance_id
        consumer = await (bus.mailbox(handler.role, me) if mailbox else bus.consumer(handler.role))
        while True:
            raise_if_cancelled()
            room = self.room(handler)
            if room <= 0:
                await asyncio.sleep(NO_ROOM_WAIT)
                continue
            self._fetching += 1
            try:
                tasks = await consumer.fetch(room, timeout=0.5)
            finally:
                self._fetching -= 1
            if mailbox:
                tasks = await self._claimed(tasks)
            if not tasks:
                continue
            self._fetched.update(tasks)  # the failover must know of them before their turn
            self.poke()
            cancelled = await self._tombstoned(tasks)
            for task in tasks:
                try:
                    await self._take(handler, task, task.message.request.request_id in cancelled)
                finally:
                    self._fetched.discard(task)

    async def _claimed(self, tasks: list[Task]) -> list[Task]:
        """The mailbox tasks this instance claimed first; the others were taken back by their
        sender (moved to the shared queue) and are settled here."""
        mine = []
        stream, me = self.ctx.bus.subjects.task_stream, self.ctx.instance_id
        for task in tasks:
            try:
                won = await self.ctx.store.registry.claim_task(stream, task.stream_seq, task.msg_id, me) == me
            except Exception as exc:  # Redis away: run it (at least once; a copy is harmless)
                log.warning("%s: cannot claim task %d (%r); taking it", me, task.stream_seq, exc)
                won = True
            if won:
                self.ctx.counters.mailbox_taken += 1
                mine.append(task)
            else:
                self.ctx.counters.taken_back += 1
                await task.ack()
        return mine

    async def _take(self, handler: StageHandler, task: Task, cancelled: bool) -> None:
        if self.ctx.draining.is_set():  # fetched as the drain began: another replica takes it
            with contextlib.suppress(Exception):
                await task.nak()
        elif cancelled or task.message.request.gateway in self.fenced_gateways:  # nobody waits
            self.ctx.counters.cancelled_unrun += 1
            await task.ack()
        else:
            await self._handle(handler, task)

    async def _tombstoned(self, tasks: list[Task]) -> set[str]:
        """The requests among `tasks` cancelled while they queued (tombstones in Redis)."""
        try:
            return await self.ctx.store.requests.cancelled(t.message.request.request_id for t in tasks)
        except Exception as exc:  # the store is away: cancels still reach held requests by broadcast
            log.warning("%s: tombstones unreadable (%r)", self.ctx.instance_id, exc)
            return set()

    async def _handle(self, handler: StageHandler, task: Task) -> None:
        rid = task.message.request.request_id
        try:
            await handler.take(task)
        except Cancelled:
            if not task.settled:  # cancelled before it was held here: dropped unrun
                self.ctx.counters.cancelled_unrun += 1
                await task.ack()
        except AlreadyHeld:
            if await self._earlier_stage_leaves(handler, rid):
                await self._handle(handler, task)  # the request's next stage, here too: take it now
                return
            log.warning(
                "%s: a second delivery of %s's %s task while it runs here; dropped",
                self.ctx.instance_id,
                rid,
                handler.role,
            )
            await task.ack()
        except Exception as exc:
            log.exception("%s task for %s failed", handler.role, rid)
            self.ctx.ledger.forget(rid)
            if not task.settled:
                await task.fail(f"{type(exc).__name__}: {exc}")

    async def _earlier_stage_leaves(self, handler: StageHandler, rid: str) -> bool:
        """Whether the request is held here for another stage that is handing it on, and lets go
        within STAGE_HANDOVER seconds. A hybrid instance runs two stages of a request with a third
        between them elsewhere (ED+P: encode here, prefill there, decode here): the decode task can
        arrive before the encode hold is settled. It is the request's next stage, not a duplicate."""
        held = self.ctx.ledger.get(rid)
        if held is None or held.role == handler.role:
            return held is None  # gone already: take it; the same stage twice: a duplicate
        deadline = time.monotonic() + STAGE_HANDOVER
        while (held := self.ctx.ledger.get(rid)) is not None and held.holds_task:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    # -- drain -------------------------------------------------------------------------------------

    async def drain(self) -> None:
        """SIGTERM: stop pulling, finish what is held (up to drain_timeout), then give back what is
        still held, so that other replicas take it at once."""
        self.ctx.draining.set()
        began = time.monotonic()
        self._drain_deadline = min(self._drain_deadline, began + self.drain_timeout)
        # A pull under way as the drain began still brings tasks; stopping before it returns would
        # strand them until their ack deadline. They are handed back as they arrive (_take).
        while (
            len(self.ctx.ledger) or self._fetching or self._fetched
        ) and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(DRAIN_POLL)
        await self.give_back()
        log.info("%s drained in %.1fs", self.ctx.instance_id, time.monotonic() - began)

    def hurry_drain(self) -> None:
        """End a drain now: what is still held goes back to the queue."""
        self._drain_deadline = 0.0

    async def give_back(self) -> None:
        """Every task still held goes back to its queue, for other replicas."""
        for held in list(self.ctx.ledger):
            log.warning(
                "%s: %s still held as it stops; its task goes back", self.ctx.instance_id, held.request_id
            )
            await self.ctx.ledger.give_back(held.request_id)
