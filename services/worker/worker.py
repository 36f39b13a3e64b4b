"""A stage worker: one engine with a role set and the handler of each role. It pulls tasks for its
roles only when the engine has room, drives their handlers, publishes what each step produced, and
drains on SIGTERM. Encoder, prefill, decode and the hybrids are all this runtime with other handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping

import torch
from prometheus_client import CollectorRegistry

from common.aio import raise_if_cancelled
from common.bus import Bus, Task, keep_alive
from common.dispatch import Dispatcher
from common.engine import Engine, EngineConfig, Policy, RequestOutput
from common.engine.admission import pull_room
from common.failover import Reaper, instance_name
from common.protocol import Budgets, Heartbeat
from common.roles import PULL_ORDER, Role, in_path_order, letters, parse_roles
from common.store import Heartbeater, Store, StoreConfig
from common.store.recorder import StageRecorder
from common.transfer import TransferConfig, create_backend
from services.settings import WorkerSettings
from services.worker import profiling
from services.worker.context import StageContext
from services.worker.cores import CoreBoard
from services.worker.counters import Counters
from services.worker.engine_loop import EngineLoop
from services.worker.ledger import AlreadyHeld, Cancelled, Ledger
from services.worker.outputs import OutputPublisher
from services.worker.stage import StageHandler
from services.worker.stage_metrics import StageMetrics
from services.worker.step_log import PUBLISH_EVERY, REPUBLISH_EVERY, StepLog

log = logging.getLogger(__name__)
CLOSE_STEP_TIMEOUT = 5.0  # seconds each part of shutdown may take
HOUSEKEEPING = 0.5  # seconds between looks for expired KV, a failed engine and (in tests) integrity
NO_ROOM_WAIT = 0.02  # seconds a pull loop waits for room in the engine


def advertise_host(value: str) -> str:
    """`auto` means this container's hostname (compose cannot expand it for us)."""
    return socket.gethostname() if value == "auto" else value


class StageWorker:
    def __init__(self, settings: WorkerSettings, stages: Mapping[Role, type[StageHandler]]) -> None:
        self.settings = settings
        self.roles = parse_roles(settings.roles)
        self.instance_id = settings.instance_id or instance_name(letters(self.roles))
        self.host = advertise_host(settings.advertise_host)
        self.stages = stages
        self.counters = Counters()
        self.registry = CollectorRegistry()  # what /metrics serves (services/worker/http.py)
        self.draining = asyncio.Event()
        self.http_address = ""
        self.profile_id = ""
        self.integrity_failures = 0
        self._outputs: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._drain_deadline = float("inf")
        self._checked = -1  # the ledger's change count at the last integrity check
        self._reconnects = 0  # NATS reconnects after which it asked whether it was fenced
        self._fetched: set[Task] = set()  # pulled, waiting their turn to be handled (not yet held)
        self._fetching = 0  # pulls under way: what they bring must be handed back, not dropped

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        config = EngineConfig(
            roles=self.roles,
            policy=Policy(s.policy),
            block_size=s.block_size,
            kv_cache_bytes=s.kv_cache_bytes,
            token_budget=s.token_budget,
            image_budget=s.image_budget,
            max_num_seqs=s.max_num_seqs,
            feature_cache_bytes=s.feature_cache_bytes,
            detokenize=False,  # the gateway makes the text
            device=s.device,
            num_threads=s.num_threads or None,
            adapt_budgets=s.adapt_budgets,
        )
        engine = await asyncio.to_thread(Engine, s.model, config)
        store = await Store.connect(StoreConfig(url=s.redis_url, prefix=s.namespace))
        # Before any task: the budgets come from the profile.
        self.profile_id = await profiling.establish(engine, store, s, self.instance_id)
        bus = await Bus.connect(s.bus_config(self.instance_id), store)
        transfer_host = "0.0.0.0" if s.bind_host == "0.0.0.0" else self.host
        transfer = create_backend(
            TransferConfig(
                backend=s.transfer,
                host=transfer_host,
                advertise_host=self.host,
                secret=s.transfer_secret,
                inline_max_bytes=s.transfer_inline_max_bytes,
            )
        )
        await transfer.start()
        self.record = StageRecorder(store)
        cores = None
        if s.core_board:
            # Instances that encode or prefill run the large steps a request's TTFT waits for.
            greedy = bool(self.roles & {Role.ENCODE, Role.PREFILL})
            cores = CoreBoard(s.core_board, s.host_cores or len(os.sched_getaffinity(0)), greedy)
        self.loop = EngineLoop(engine, self._outputs.put_nowait, cores)
        self.ledger = Ledger(self.loop, transfer, self.record, finals_window=s.finals_window)
        self.metrics = StageMetrics(self.registry, self.instance_id, ",".join(sorted(self.roles)))
        self.steps = StepLog()

        def on_step(batch, seconds: float) -> None:  # on the engine thread
            self.metrics.step(batch.kind, seconds)
            if cores is not None:
                threads, overlap = cores.step_threads(), cores.step_overlap()
            else:  # which other steps ran beside it is not known
                threads, overlap = torch.get_num_threads(), None
            self.steps.record(batch, seconds, engine.scheduler.image_unit, threads, overlap)

        engine.on_step = on_step
        self.ctx = StageContext(
            self.instance_id, self.roles, self.loop, self.ledger, bus, store, transfer,
            Dispatcher(bus.tasks, self.record), self.counters, self.draining, metrics=self.metrics,
        )  # fmt: skip
        self.handlers = {
            role: self.stages[role].from_settings(self.ctx, s) for role in in_path_order(self.roles)
        }
        self.outputs = OutputPublisher.for_handlers(self.ctx, self.handlers.values())
        self.loop.start()
        self.heartbeats = Heartbeater(
            store.registry,
            self.heartbeat,
            s.heartbeat_interval,
            s.heartbeat_ttl,
            publish=bus.events.heartbeat,
        )
        self.ledger.on_begin = self.heartbeats.poke  # a task taken is a task the failover must know of
        self.reaper = Reaper(
            bus, store, self.instance_id, s.failover_after, self._fenced, s.unresponsive_after
        )
        self.heartbeats.start()
        log.info("%s ready: roles %s, transfer %s", self.instance_id, sorted(self.roles), transfer.address)

    async def run(self) -> None:
        """Pull, hand on and publish until drained; every background task is owned here."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump_outputs())
            tg.create_task(self.record.run())
            tg.create_task(keep_alive(self._tasks, self.ctx.bus.config.keep_alive_period))
            tg.create_task(self._housekeeping())
            tg.create_task(self._publish_steps())
            tg.create_task(self.reaper.run())
            tg.create_task(self.ctx.watch_cancels())
            tg.create_task(self.outputs.watch())  # gateways' Resends: the one output recovery rule
            for handler in self.handlers.values():
                tg.create_task(handler.watch())
            for role in PULL_ORDER:
                if role in self.handlers:
                    tg.create_task(self._pull_loop(self.handlers[role]))
            await self._stop.wait()
            raise _Stopped

    def request_stop(self) -> None:
        self._stop.set()

    async def drain(self) -> None:
        """SIGTERM: stop pulling, finish what is held (up to drain_timeout), then leave the registry."""
        self.draining.set()
        began = time.monotonic()
        self._drain_deadline = began + self.settings.drain_timeout
        # A pull under way as the drain began still brings tasks; stopping before it returns would
        # strand them until their ack deadline. They are handed back as they arrive (_take).
        while (
            len(self.ledger) or self._fetching or self._fetched
        ) and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.1)
        for held in self.ledger:  # still held at the deadline: tasks go back for other replicas
            log.warning(
                "%s: %s still held when draining ended; its task goes back", self.instance_id, held.request_id
            )
            await self.ledger.give_back(held.request_id)
        await self._check_integrity()
        log.info("%s drained in %.1fs", self.instance_id, time.monotonic() - began)
        self.request_stop()

    def hurry_drain(self) -> None:
        """End a drain now: what is still held goes back to the queue."""
        self._drain_deadline = 0.0

    async def close(self) -> None:
        """Release everything in order, each step bounded: one stuck client must not keep a stopping
        process alive until its orchestrator kills it, skipping the steps after."""
        await self.record.flush()
        for step in (
            self._stop_heartbeats,
            self.loop.stop,
            self.ctx.bus.close,
            self.ctx.transfer.close,
            self.ctx.store.close,
        ):
            try:
                await asyncio.wait_for(step(), CLOSE_STEP_TIMEOUT)
            except TimeoutError:
                log.warning(
                    "%s: %s took over %.0fs; going on",
                    self.instance_id,
                    step.__qualname__,
                    CLOSE_STEP_TIMEOUT,
                )
            except Exception as exc:
                log.warning("%s: %s failed: %r", self.instance_id, step.__qualname__, exc)
        if self.loop.cores is not None:
            self.loop.cores.close()  # the slot is free for the next worker on this host

    async def _stop_heartbeats(self) -> None:
        """A last, leaving heartbeat and out of the registry — unless taken for dead: then it says
        nothing more, not even goodbye."""
        await self.heartbeats.stop(deregister=not self.ctx.fenced.is_set())

    # -- what others read --------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        stats = self.loop.stats
        return Heartbeat(
            instance_id=self.instance_id,
            roles=in_path_order(self.roles),
            held=tuple(task.stream_seq for task in self._tasks()),
            http_address=self.http_address,
            transfer_address=self.ctx.transfer.address,
            queue_depth=stats.waiting,
            running=stats.running,
            free_kv_blocks=stats.free_blocks,
            total_kv_blocks=stats.total_blocks,
            budgets=Budgets(image_budget=stats.image_budget, token_budget=stats.token_budget),
            profile_id=self.profile_id,
            draining=self.draining.is_set(),
            started_at=self.counters.started_at,
            time=time.time(),
        )

    def room(self, role: Role) -> int:
        """How many tasks of `role` to ask for now: what the batcher can take soon, no more."""
        if self.draining.is_set() or self.ctx.fenced.is_set():
            return 0
        stats = self.loop.stats
        return pull_room(
            role, waiting=stats.waiting, free_blocks=stats.free_blocks, image_budget=stats.image_budget,
            running=stats.running, token_budget=stats.token_budget,
        )  # fmt: skip

    # -- loops -------------------------------------------------------------------------------------

    async def _pull_loop(self, handler: StageHandler) -> None:
        consumer = await self.ctx.bus.consumer(handler.role)
        while not self._stop.is_set():
            raise_if_cancelled()
            room = self.room(handler.role)
            if room <= 0:
                await asyncio.sleep(NO_ROOM_WAIT)
                continue
            self._fetching += 1
            try:
                tasks = await consumer.fetch(room, timeout=0.5)
            finally:
                self._fetching -= 1
            if not tasks:
                continue
            self._fetched.update(tasks)  # the failover must know of them before their turn
            self.heartbeats.poke()
            cancelled = await self._tombstoned(tasks)
            for task in tasks:
                try:
                    await self._take(handler, task, task.message.request.request_id in cancelled)
                finally:
                    self._fetched.discard(task)

    async def _take(self, handler: StageHandler, task: Task, cancelled: bool) -> None:
        if self.draining.is_set():  # fetched as the drain began: another replica takes it
            with contextlib.suppress(Exception):
                await task.nak()
        elif cancelled or task.message.request.gateway in self.reaper.fenced:  # nobody waits for it
            self.counters.cancelled_unrun += 1
            await task.ack()
        else:
            await self._handle(handler, task)

    def _tasks(self) -> list[Task]:
        """Every task this instance has and has not settled: held, or pulled and waiting."""
        held = self.ledger.tasks()
        return held + [t for t in self._fetched if not t.settled and t not in held]

    async def _tombstoned(self, tasks: list[Task]) -> set[str]:
        """The requests among `tasks` cancelled while they queued (tombstones in Redis)."""
        try:
            return await self.ctx.store.requests.cancelled(t.message.request.request_id for t in tasks)
        except Exception as exc:  # the store is away: cancels still reach held requests by broadcast
            log.warning("%s: tombstones unreadable (%r)", self.instance_id, exc)
            return set()

    async def _handle(self, handler: StageHandler, task: Task) -> None:
        rid = task.message.request.request_id
        try:
            await handler.take(task)
        except Cancelled:
            if not task.settled:  # cancelled before it was held here: dropped unrun
                self.counters.cancelled_unrun += 1
                await task.ack()
        except AlreadyHeld:
            log.warning(
                "%s: a second delivery of %s's %s task while it runs here; dropped",
                self.instance_id,
                rid,
                handler.role,
            )
            await task.ack()
        except Exception as exc:
            log.exception("%s task for %s failed", handler.role, rid)
            self.ledger.forget(rid)
            if not task.settled:
                await task.fail(f"{type(exc).__name__}: {exc}")

    async def _pump_outputs(self) -> None:
        while True:
            raise_if_cancelled()
            await self.outputs.publish(await self._outputs.get())

    async def _publish_steps(self) -> None:
        """The engine's last steps and the budgets in force, for the planner's calibration; a
        Redis outage skips a round (the planner uses what it has)."""
        published, published_at = -1, 0.0
        while True:
            raise_if_cancelled()
            await asyncio.sleep(PUBLISH_EVERY)
            fresh = time.monotonic() - published_at < REPUBLISH_EVERY
            if not len(self.steps) or (self.loop.steps == published and fresh):
                continue
            s = self.loop.stats
            stats = self.steps.stats(
                self.instance_id,
                self.roles,
                self.profile_id,
                (s.image_budget, s.token_budget),
                s.budget_scale,
            )
            try:
                await self.ctx.store.planning.put_steps(stats)
                published, published_at = self.loop.steps, time.monotonic()
            except Exception as exc:
                log.warning("%s: step stats not published (%r)", self.instance_id, exc)

    async def _housekeeping(self) -> None:
        """Free KV nobody came for and finals past their window, drop the requests of dead
        gateways, stop on a failed engine, and (tests) check the ledger's integrity."""
        while True:
            raise_if_cancelled()
            slept = time.monotonic()
            await asyncio.sleep(HOUSEKEEPING)
            await self.ledger.expire()
            for held in self.ledger:
                if held.spec.gateway in self.reaper.fenced:
                    await self.ledger.abort(held.request_id)
            frozen = time.monotonic() - slept > self.settings.failover_after  # e.g. SIGSTOP
            if (frozen or self.ctx.bus.reconnects != self._reconnects) and await self._found_dead():
                return
            self._reconnects = self.ctx.bus.reconnects
            if self.loop.failure is not None:
                raise RuntimeError("engine thread failed") from self.loop.failure
            if self.ledger.changes != self._checked:
                await self._check_integrity()

    def _fenced(self, instance_id: str) -> None:
        """Another instance was found dead; if it is this one (it was frozen, and came back), it
        does nothing more and leaves: its tasks went to others."""
        if instance_id == self.instance_id and not self.ctx.fenced.is_set():
            log.error("%s was taken for dead and its work handed on; leaving", self.instance_id)
            self.ctx.fenced.set()
            self.request_stop()

    async def _found_dead(self) -> bool:
        """After a freeze or an outage the fence broadcast may have been missed: ask the registry."""
        try:
            if await self.ctx.store.registry.is_fenced(self.instance_id):
                self._fenced(self.instance_id)
        except Exception as exc:
            log.warning("%s: could not ask whether it was taken for dead: %r", self.instance_id, exc)
        return self.ctx.fenced.is_set()

    async def _check_integrity(self) -> None:
        """With `check_integrity` on (tests): the ledger and the engine agree, and an instance that
        holds nothing holds no blocks. A failure is logged and counted, never raised."""
        if not self.settings.check_integrity:
            return
        self._checked = self.ledger.changes
        try:
            await self.ledger.check_integrity()
        except AssertionError as exc:
            self.integrity_failures += 1
            log.error("%s: integrity check failed: %s", self.instance_id, exc)


class _Stopped(Exception):
    """Ends the worker's task group once a stop was requested."""
