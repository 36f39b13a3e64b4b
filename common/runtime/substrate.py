"""One service's runtime: the substrate clients built once, its loops supervised, and an ordered close.

    runtime = await Runtime.connect(settings, instance_id, transfer=..., registered=True)
    service = Service(settings, runtime, ...)          # everything it holds, in its constructor
    runtime.start(service.heartbeat)                   # recorder, heartbeats, failover watch
    runtime.supervise("intake", service.pull)          # and the service's own loops
    failure = await runtime.wait()                     # a stop was asked for, or a loop failed
    await runtime.close(leave=..., closers=[...])      # loops, closers, records, heartbeats, clients

Worker, gateway and planner all start this way; what differs is which parts they ask for (a
planner has no heartbeats, failover watch or transfer endpoint) and their own loops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from common.bus import Bus, BusConfig
from common.dispatch import Dispatcher
from common.failover import Reaper
from common.protocol import Heartbeat
from common.runtime.supervisor import Loop, LoopFailure, Supervisor
from common.store import Heartbeater, Store, StoreConfig
from common.store.recorder import StageRecorder
from common.tls import Tls
from common.transfer import TransferBackend, TransferConfig, create_backend

log = logging.getLogger(__name__)
CLOSE_STEP_TIMEOUT = 5.0  # seconds each step of a close may take
EXIT_LOOP_FAILED = 70  # the exit status of a service one of whose loops failed (EX_SOFTWARE)
OWN_LOOPS = ("recorder", "heartbeats", "reaper", "take-backs")  # what the runtime itself runs

Step = Callable[[], Awaitable[object]]


def exit_now(status: int) -> None:
    """End the process at once with `status`, what was logged and printed flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)


class SubstrateSettings(Protocol):
    """What the runtime reads of a service's settings (services/settings.py ServiceSettings)."""

    redis_url: str
    namespace: str
    tls: Tls | None
    heartbeat_interval: float
    failover_after: float
    unresponsive_after: float

    def bus_config(self, name: str) -> BusConfig: ...


class Runtime:
    """Built by `connect`; a service holds one and never builds a client of its own."""

    def __init__(
        self,
        instance_id: str,
        settings: SubstrateSettings,
        store: Store,
        bus: Bus,
        transfer: TransferBackend | None,
        heartbeat_ttl: float | None,
        registered: bool,
    ) -> None:
        self.instance_id = instance_id
        self.store = store
        self.bus = bus
        self.transfer = transfer
        self.record = StageRecorder(store)  # request records, written off the request path
        self.dispatch = Dispatcher(bus.tasks, self.record, bus, store.registry, sender=instance_id)
        self.loops = Supervisor(instance_id)
        self.reaper = Reaper(bus, store, instance_id, settings, self._fenced)
        self.heartbeats = Heartbeater(
            store.registry if registered else None,
            self._beat,
            settings.heartbeat_interval,
            heartbeat_ttl,
            publish=bus.events.heartbeat,
        )
        self._heartbeat: Callable[[], Heartbeat] | None = None  # the service's, given to start()
        self._fence_listeners: list[Callable[[str], None]] = []

    @classmethod
    async def connect(
        cls,
        settings: SubstrateSettings,
        instance_id: str,
        *,
        transfer: TransferConfig | None = None,
        heartbeat_ttl: float | None = None,
        registered: bool = False,
        dead_letters: bool = True,
    ) -> Runtime:
        """Redis, NATS and (given its config) the transfer endpoint, each connected once. With
        `registered` the heartbeats are written to the registry too (workers); `dead_letters`
        records tasks that ran out of deliveries."""
        store = await Store.connect(
            StoreConfig(url=settings.redis_url, prefix=settings.namespace, tls=settings.tls)
        )
        try:
            bus = await Bus.connect(settings.bus_config(instance_id), store if dead_letters else None)
        except BaseException:
            await store.close()
            raise
        backend = create_backend(transfer) if transfer is not None else None
        try:
            if backend is not None:
                await backend.start()
        except BaseException:
            await bus.close()
            await store.close()
            raise
        return cls(instance_id, settings, store, bus, backend, heartbeat_ttl, registered)

    # -- running -----------------------------------------------------------------------------------

    def start(self, heartbeat: Callable[[], Heartbeat] | None) -> None:
        """Start the runtime's own loops: the recorder always; with a `heartbeat` (the service's
        current one), beating and watching the others for deaths."""
        self.loops.start("recorder", self.record.run)
        self.loops.start("take-backs", self.dispatch.take_backs)  # tasks sent to one instance
        if heartbeat is not None:
            self._heartbeat = heartbeat
            self.loops.start("heartbeats", self.heartbeats.run)
            self.loops.start("reaper", self.reaper.run)

    def supervise(
        self, name: str, run: Loop, *, may_end: bool = False, stop: Callable[[], None] | None = None
    ) -> None:
        """Run one of the service's loops under supervision (see Supervisor.start)."""
        self.loops.start(name, run, may_end=may_end, stop=stop)

    def on_fence(self, listener: Callable[[str], None]) -> None:
        """Call `listener(instance_id)` for every instance taken for dead (this one too)."""
        self._fence_listeners.append(listener)

    def request_stop(self) -> None:
        self.loops.request_stop()

    async def wait(self) -> LoopFailure | None:
        """Until a stop is asked for or a loop fails; the failure, if that was it."""
        return await self.loops.wait()

    @property
    def failure(self) -> LoopFailure | None:
        return self.loops.failure

    def health(self) -> str | None:
        """Why the service is unhealthy (a loop failed), or None."""
        return str(self.failure) if self.failure is not None else None

    # -- stopping ----------------------------------------------------------------------------------

    async def close(self, *, leave: bool = True, closers: Sequence[Step] = ()) -> None:
        """Stop in order, each step bounded, a failing step logged and passed: the service's loops;
        the service's `closers` (giving back tasks, stopping an engine); the request records
        written; the runtime's loops; a last, leaving heartbeat (unless not `leave`: taken for
        dead, it says nothing more); the clients."""
        await self.loops.stop([n for n in self.loops.running() if n not in OWN_LOOPS])
        for step in closers:
            await self._bounded(step)
        await self._bounded(self.record.flush)
        await self.loops.stop()
        if self._heartbeat is not None:
            await self._bounded(lambda: self.heartbeats.stop(deregister=leave))
        await self._bounded(self.bus.close)
        if self.transfer is not None:
            await self._bounded(self.transfer.close)
        await self._bounded(self.store.close)

    async def exit_on_failure(
        self, closers: Sequence[Step] = (), exit: Callable[[int], object] = exit_now
    ) -> None:
        """For a service whose HTTP server owns the process (uvicorn.run): once a loop fails,
        close in order and end the process with EXIT_LOOP_FAILED. Returns at a stop request.

        The process ends here, not through uvicorn: its graceful shutdown would wait for every
        open response, and a service missing one of its loops must not answer any more. What was
        logged is flushed first."""
        failure = await self.wait()
        if failure is None:
            return
        await self.close(closers=closers)
        log.critical("%s exits: %s", self.instance_id, failure)
        exit(EXIT_LOOP_FAILED)

    async def _bounded(self, step: Step) -> None:
        name = getattr(step, "__qualname__", repr(step))
        try:
            await asyncio.wait_for(step(), CLOSE_STEP_TIMEOUT)
        except TimeoutError:
            log.warning("%s: %s took over %.0fs; going on", self.instance_id, name, CLOSE_STEP_TIMEOUT)
        except Exception as exc:
            log.warning("%s: %s failed: %r", self.instance_id, name, exc)

    def _beat(self) -> Heartbeat:
        assert self._heartbeat is not None, "heartbeats run only after start(heartbeat)"
        return self._heartbeat()

    def _fenced(self, instance_id: str) -> None:
        for listener in self._fence_listeners:
            listener(instance_id)
