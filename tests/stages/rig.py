"""A stage handler on its own: a real engine, NATS, Redis and transfer, wired into a StageContext the
way a worker wires it, with no pull loop, no HTTP and no other process. Tests fetch a task and call
the handler's `take` themselves, so they choose what happens between its awaits."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from common.aio import raise_if_cancelled
from common.bus import Bus, BusConfig, Task
from common.dispatch import Dispatcher
from common.engine import Engine, EngineConfig
from common.infra import NatsServer, RedisServer
from common.roles import Role, in_path_order, letters
from common.store import Store, StoreConfig
from common.store.recorder import StageRecorder
from common.transfer import TcpBackend, TransferBackend, TransferConfig
from services.settings import WorkerSettings
from services.stages import STAGES
from services.worker.context import StageContext
from services.worker.counters import Counters
from services.worker.engine_loop import EngineLoop
from services.worker.engine_settings import engine_config
from services.worker.finals import FINALS_WINDOW
from services.worker.ledger import Ledger
from services.worker.outputs import OutputPublisher
from services.worker.stage import StageHandler

NAMESPACE = "stages"
INLINE_MAX = 1024  # bytes: features and KV of the tiny model travel by handle, so they are pulled
ACK_WAIT = 5.0  # seconds before NATS delivers an unsettled task again (production's is 30)


class ServingThread:
    """A TCP transfer backend that serves from a thread and event loop of its own. `freeze()` stops
    it answering (its loop blocks) until `thaw()`, the way a stalled owner would."""

    def __init__(self, inline_max_bytes: int = INLINE_MAX, host_local_min_bytes: int = 1 << 20) -> None:
        config = TransferConfig(
            backend="tcp", inline_max_bytes=inline_max_bytes, host_local_min_bytes=host_local_min_bytes
        )
        self.backend = TcpBackend(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="serving", daemon=True)
        self._open = threading.Event()
        self._open.set()
        self._crashed = False

    def start(self) -> TransferBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.backend.start(), self._loop).result(10)
        return self.backend

    def freeze(self) -> None:
        self._open.clear()
        self._loop.call_soon_threadsafe(self._open.wait)

    def thaw(self) -> None:
        self._open.set()

    def crash(self) -> None:
        """Stop serving at once, as a process that died: its connections drop, mid-pull or not."""
        self._crashed = True
        asyncio.run_coroutine_threadsafe(self.backend.close(), self._loop).result(10)

    def close(self) -> None:
        self.thaw()
        if not self._crashed:
            asyncio.run_coroutine_threadsafe(self.backend.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@dataclass
class StageRig:
    ctx: StageContext
    handlers: dict[Role, StageHandler]
    serving: ServingThread
    outputs: OutputPublisher

    @property
    def engine(self) -> Engine:
        return self.ctx.engine.engine

    @property
    def ledger(self) -> Ledger:
        return self.ctx.ledger

    async def fetch(self, role: Role, timeout: float = 20.0) -> Task:
        """The next task queued for `role`, waiting for it to be queued."""
        consumer = await self.ctx.bus.consumer(role)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if tasks := await consumer.fetch(1, timeout=0.5):
                return tasks[0]
        raise TimeoutError(f"no {role} task within {timeout}s")

    async def take(self, role: Role) -> Task:
        """Fetch the next `role` task and run its handler's `take` on it."""
        task = await self.fetch(role)
        await self.handlers[role].take(task)
        return task

    async def until(self, check, timeout: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what or check} not reached within {timeout}s")
            await asyncio.sleep(0.01)

    async def idle(self, timeout: float = 20.0) -> None:
        """Wait until the instance holds nothing, then check that the engine agrees: no request, no
        block in use, and its own bookkeeping whole."""
        await self.until(lambda: len(self.ledger) == 0, timeout, "an empty ledger")
        await self.ledger.check_integrity()
        e = self.engine
        held = await self.ctx.engine.call(lambda: (set(e.requests), e.blocks.num_free, e.blocks.num_blocks))
        assert held == (set(), e.blocks.num_blocks, e.blocks.num_blocks), f"the engine still holds {held}"


@contextlib.asynccontextmanager
async def stage_rig(
    roles: frozenset[Role], model: Path, nats: NatsServer, redis: RedisServer,
    finals_window: float = FINALS_WINDOW, host_local_min_bytes: int = 1 << 20,
    settings: WorkerSettings | None = None, ack_wait: float = ACK_WAIT, **engine: object,
) -> AsyncIterator[StageRig]:  # fmt: skip
    """`roles`' handlers on one engine, as one instance. With `settings`, the engine and handlers are
    configured from them as a worker configures its own (`engine` still overrides the engine's).
    Rigs that share a test share their consumers: give them all the same `ack_wait`."""
    if settings is None:  # `engine` may override these defaults too
        config = EngineConfig(**{"roles": roles, "detokenize": False, "kv_cache_bytes": 16 << 20, **engine})
    else:
        config = dataclasses.replace(engine_config(settings, roles), **engine)
    loaded = await asyncio.to_thread(Engine, model, config)
    store = await Store.connect(StoreConfig(url=redis.url, prefix=NAMESPACE))
    name = f"{letters(roles)}-rig"
    bus = await Bus.connect(BusConfig(url=nats.url, prefix=NAMESPACE, name=name, ack_wait=ack_wait), store)
    inline = INLINE_MAX if settings is None else settings.transfer_inline_max_bytes
    serving = ServingThread(inline, host_local_min_bytes=host_local_min_bytes)
    transfer = serving.start()
    record = StageRecorder(store)
    steps: asyncio.Queue = asyncio.Queue()
    loop = EngineLoop(loaded, steps.put_nowait)
    loop.start()
    ledger = Ledger(loop, transfer, record, finals_window=finals_window)
    dispatch = Dispatcher(bus.tasks, record, bus, store.registry, sender=name)  # as the runtime builds it
    ctx = StageContext(name, roles, loop, ledger, bus, store, transfer, dispatch, Counters())
    handlers = {
        role: STAGES[role](ctx) if settings is None else STAGES[role].from_settings(ctx, settings)
        for role in in_path_order(roles)
    }
    publisher = OutputPublisher.for_handlers(ctx, handlers.values())

    async def pump() -> None:
        while True:
            raise_if_cancelled()  # a cancel nats-py swallowed mid-publish (common/aio.py) still ends it
            await publisher.publish(await steps.get())

    watches = [h.watch() for h in handlers.values()]
    jobs = (pump(), record.run(), ctx.watch_cancels(), publisher.watch(), *watches)
    background = [asyncio.create_task(job) for job in jobs]
    try:
        yield StageRig(ctx, handlers, serving, publisher)
    finally:
        for job in background:
            job.cancel()
        ended = await asyncio.gather(*background, return_exceptions=True)
        failed = [e for e in ended if isinstance(e, Exception)]  # a cancelled job returns CancelledError
        await loop.stop()
        await bus.close()
        serving.close()
        await store.close()
        if failed:
            raise failed[0]
