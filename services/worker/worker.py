"""A stage worker: one engine with a role set, pulling tasks for its roles only when it has room,
handing requests on, and draining on SIGTERM. Encoder, prefill, decode and the hybrids are all
this class with different roles."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from common.bus import Bus, Task
from common.engine import Engine, EngineConfig, Policy, RequestOutput
from common.engine.admission import pull_room
from common.protocol import Budgets, Heartbeat, RequestSpec
from common.roles import PULL_ORDER, letters, parse_roles
from common.store import Heartbeater, Store, StoreConfig
from common.store.recorder import StageRecorder
from common.transfer import TransferConfig, create_backend
from services.settings import WorkerSettings
from services.worker import profiling
from services.worker.engine_loop import EngineLoop
from services.worker.handlers import HANDLERS
from services.worker.outputs import KV_TTL, publish_outputs
from services.worker.state import Counters, Held, KeptKV

log = logging.getLogger(__name__)
CLOSE_STEP_TIMEOUT = 5.0  # seconds each part of shutdown may take


def advertise_host(value: str) -> str:
    """`auto` means this container's hostname (compose cannot expand it for us)."""
    return socket.gethostname() if value == "auto" else value


class StageWorker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.roles = parse_roles(settings.roles)
        self.instance_id = (
            settings.instance_id or f"{letters(self.roles)}-{socket.gethostname()}-{os.getpid()}"
        )
        self.host = advertise_host(settings.advertise_host)
        self.held: dict[str, Held] = {}
        self.specs: dict[str, RequestSpec] = {}
        self.kept_kv: dict[str, KeptKV] = {}
        self.counters = Counters()
        self.draining = False
        self.http_address = ""
        self.profile_id = ""
        self._outputs: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._drain_deadline = float("inf")

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
        self.engine = await asyncio.to_thread(Engine, s.model, config)
        self.store = await Store.connect(StoreConfig(url=s.redis_url, prefix=s.namespace))
        self.profile_id = await profiling.establish(self)  # before any task: budgets come from it
        self.bus = await Bus.connect(s.bus_config(self.instance_id), self.store)
        transfer_host = "0.0.0.0" if s.bind_host == "0.0.0.0" else self.host
        self.transfer = create_backend(
            TransferConfig(backend=s.transfer, host=transfer_host, advertise_host=self.host)
        )
        await self.transfer.start()
        self.record = StageRecorder(self.store)
        self.loop = EngineLoop(self.engine, self._outputs.put_nowait)
        self.loop.start()
        self.heartbeats = Heartbeater(
            self.store.registry,
            self.heartbeat,
            s.heartbeat_interval,
            s.heartbeat_ttl,
            also=self.bus.events.heartbeat,
        )
        self.heartbeats.start()
        log.info(
            "%s ready: roles %s, transfer %s", self.instance_id, sorted(self.roles), self.transfer.address
        )

    async def run(self) -> None:
        """Pull, hand on and publish until drained; every background task is owned here."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump_outputs())
            tg.create_task(self.record.run())
            tg.create_task(self._keep_tasks_alive())
            tg.create_task(self._watch_cancels())
            tg.create_task(self._watch_releases())
            for role in PULL_ORDER:
                if role in self.roles:
                    tg.create_task(self._pull_loop(role))
            await self._stop.wait()
            raise _Stopped

    def request_stop(self) -> None:
        self._stop.set()

    async def drain(self) -> None:
        """SIGTERM: stop pulling, finish what is held (up to drain_timeout), then leave the registry."""
        self.draining = True
        began = time.monotonic()
        self._drain_deadline = began + self.settings.drain_timeout
        while (self.held or self.kept_kv) and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.1)
        for rid in list(self.held):  # still held at the deadline: give the tasks back for others
            held = self.held.pop(rid)
            log.warning("%s: %s still held when draining ended; its task goes back", self.instance_id, rid)
            if held.task is not None and not held.task.settled:
                with contextlib.suppress(Exception):
                    await held.task.nak()
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
            self.heartbeats.stop,
            self.loop.stop,
            self.bus.close,
            self.transfer.close,
            self.store.close,
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

    # -- bookkeeping -------------------------------------------------------------------------------

    def begin(self, held: Held, spec: RequestSpec | None = None) -> None:
        self.held[held.request_id] = held
        if spec is not None:
            self.specs[held.request_id] = spec

    async def settle(self, rid: str, keep_spec: bool = False) -> None:
        """The request left this instance (finished, failed or handed on): ack its task."""
        held = self.held.pop(rid, None)
        if not keep_spec:
            self.specs.pop(rid, None)
        if held is not None and held.task is not None and not held.task.settled:
            await held.task.ack()

    def msg_id(self, rid: str, kind: str) -> str:
        """JetStream de-duplication id for a task this instance publishes on behalf of `rid`: the
        same if this very step is retried (e.g. across a NATS restart), different for any later
        step of the request (a request may pass through prefill twice after a loss)."""
        held = self.held.get(rid)
        source = held.task.stream_seq if held is not None and held.task is not None else "local"
        return f"{rid}:{kind}:from-{source}"

    def heartbeat(self) -> Heartbeat:
        stats = self.loop.stats
        return Heartbeat(
            instance_id=self.instance_id,
            roles=tuple(sorted(r.value for r in self.roles)),
            http_address=self.http_address,
            transfer_address=self.transfer.address,
            queue_depth=stats.get("waiting", 0),
            running=stats.get("running", 0),
            free_kv_blocks=stats.get("free_blocks", 0),
            total_kv_blocks=self.engine.blocks.num_blocks,
            budgets=Budgets(
                image_budget=self.engine.scheduler.image_budget,
                token_budget=self.engine.scheduler.token_budget,
            ),
            profile_id=self.profile_id,
            draining=self.draining,
            started_at=self.counters.started_at,
            time=time.time(),
        )

    def room(self, role: str) -> int:
        """How many tasks of `role` to ask for now: what the batcher can take soon, no more."""
        if self.draining:
            return 0
        stats = self.loop.stats
        return pull_room(
            role,
            waiting=stats.get("waiting", 0),
            free_blocks=stats.get("free_blocks", 0),
            image_budget=self.engine.scheduler.image_budget,
            running=stats.get("running", 0),
            token_budget=self.engine.scheduler.token_budget,
        )

    # -- loops -------------------------------------------------------------------------------------

    async def _pull_loop(self, role: str) -> None:
        consumer = await self.bus.consumer(role)
        while not self._stop.is_set():
            room = self.room(role)
            if room <= 0:
                await asyncio.sleep(0.02)
                continue
            for task in await consumer.fetch(room, timeout=0.5):
                await self._handle(role, task)

    async def _handle(self, role: str, task: Task) -> None:
        rid = task.message.request.request_id
        try:
            await HANDLERS[role](self, task)
        except Exception as exc:
            log.exception("%s task for %s failed", role, rid)
            self.held.pop(rid, None)
            self.specs.pop(rid, None)
            with contextlib.suppress(Exception):
                await self.loop.call(lambda: self.engine.abort(rid))
            if not task.settled:
                await task.fail(f"{type(exc).__name__}: {exc}")

    async def _pump_outputs(self) -> None:
        while True:
            await publish_outputs(self, await self._outputs.get())

    async def _keep_tasks_alive(self) -> None:
        """In-progress acks for every held task, and expiry of KV nobody came for."""
        period = max(0.5, self.bus.config.ack_wait / 3)
        while True:
            await asyncio.sleep(period)
            for held in list(self.held.values()):
                if held.task is not None and not held.task.settled:
                    with contextlib.suppress(Exception):
                        await held.task.msg.in_progress()
            now = time.time()
            for rid in [r for r, k in self.kept_kv.items() if k.expires < now]:
                log.warning("KV of %s was not pulled within %.0fs; freeing it", rid, KV_TTL)
                await self._release_kv(rid)
            if self.loop.failure is not None:
                raise RuntimeError("engine thread failed") from self.loop.failure

    async def _watch_cancels(self) -> None:
        async with await self.bus.events.cancels() as stream:
            async for cancel in stream:
                rid = cancel.request_id
                if rid in self.held:
                    await self.loop.call(lambda r=rid: self.engine.abort(r))
                    await self.settle(rid)
                if rid in self.kept_kv:
                    await self._release_kv(rid)

    async def _watch_releases(self) -> None:
        async with await self.bus.events.releases(self.instance_id) as stream:
            async for release in stream:
                await self._release_kv(release.request_id)

    async def _release_kv(self, rid: str) -> None:
        kept = self.kept_kv.pop(rid, None)
        if kept is None:
            return
        for handle in kept.handles:
            self.transfer.release(handle)
        await self.loop.call(lambda: self.engine.release(rid))


class _Stopped(Exception):
    """Ends the worker's task group once a stop was requested."""
