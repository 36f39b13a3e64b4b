"""A worker's periodic upkeep, each a loop the runtime supervises: freeing what nobody came for,
noticing it was taken for dead or that its engine failed, checking the ledger (tests), and
publishing its recent steps for the planner."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.aio import raise_if_cancelled
from common.bus import Bus
from common.protocol import StepStats
from common.roles import Role
from common.store import Store
from services.worker.cpu_use import CpuUse
from services.worker.engine_loop import EngineLoop
from services.worker.ledger import Ledger
from services.worker.step_log import PUBLISH_EVERY, REPUBLISH_EVERY, StepLog

log = logging.getLogger(__name__)
HOUSEKEEPING = 0.5  # seconds between looks for expired KV, a failed engine and (in tests) integrity


@dataclass(kw_only=True, eq=False)
class Housekeeping:
    instance_id: str
    ledger: Ledger
    engine: EngineLoop
    bus: Bus
    store: Store
    fenced_gateways: set[str]  # gateways found dead: their requests are dropped here
    on_fenced: Callable[[str], None]  # told when the registry says this instance was taken for dead
    is_fenced: Callable[[], bool]
    failover_after: float  # seconds of silence after which others take an instance for dead
    check: bool  # check the ledger's integrity whenever it changed (TRIDENT_CHECK_INTEGRITY: tests)
    integrity_failures: int = field(default=0, init=False)
    _checked: int = field(default=-1, init=False)  # the ledger's change count at the last integrity check
    _reconnects: int = field(default=0, init=False)  # NATS reconnects after which it asked if fenced

    async def run(self) -> None:
        """Free KV nobody came for and finals past their window, drop the requests of dead gateways,
        fail on a failed engine, and (tests) check the ledger's integrity. Returns once
        this instance turns out to have been taken for dead (it is stopping then)."""
        while True:
            raise_if_cancelled()
            slept = time.monotonic()
            await asyncio.sleep(HOUSEKEEPING)
            await self.ledger.expire()
            for held in self.ledger:
                if held.spec.gateway in self.fenced_gateways:
                    await self.ledger.abort(held.request_id)
            frozen = time.monotonic() - slept > self.failover_after  # e.g. SIGSTOP
            if (frozen or self.bus.reconnects != self._reconnects) and await self._found_dead():
                return
            self._reconnects = self.bus.reconnects
            if self.engine.failure is not None:
                raise RuntimeError("engine thread failed") from self.engine.failure
            if self.ledger.changes != self._checked:
                await self.check_integrity()

    async def _found_dead(self) -> bool:
        """After a freeze or an outage the fence broadcast may have been missed: ask the registry."""
        try:
            if await self.store.registry.is_fenced(self.instance_id):
                self.on_fenced(self.instance_id)
        except Exception as exc:
            log.warning("%s: could not ask whether it was taken for dead: %r", self.instance_id, exc)
        return self.is_fenced()

    async def check_integrity(self) -> None:
        """With `check_integrity` on (tests): the ledger and the engine agree, and an instance that
        holds nothing holds no blocks. A failure is logged and counted, never raised."""
        if not self.check:
            return
        self._checked = self.ledger.changes
        try:
            await self.ledger.check_integrity()
        except AssertionError as exc:
            self.integrity_failures += 1
            log.error("%s: integrity check failed: %s", self.instance_id, exc)


@dataclass(kw_only=True, eq=False)
class StepPublisher:
    """The engine's last steps and the budgets in force, for the planner's calibration; a Redis
    outage skips a round (the planner uses what it has)."""

    instance_id: str
    roles: frozenset[Role]
    profile_id: str  # the stage profile the budgets came from
    steps: StepLog
    engine: EngineLoop
    store: Store
    cores: int = 0  # the host's cores this worker's steps share with others (0: on a GPU)
    cpu: CpuUse = field(init=False)

    def __post_init__(self) -> None:
        self.cpu = CpuUse(self.cores)

    async def run(self) -> None:
        published, published_at = -1, 0.0
        while True:
            raise_if_cancelled()
            await asyncio.sleep(PUBLISH_EVERY)
            fresh = time.monotonic() - published_at < REPUBLISH_EVERY
            if not len(self.steps) or (self.engine.steps == published and fresh):
                continue
            try:
                await self.store.planning.put_steps(self._stats())
                published, published_at = self.engine.steps, time.monotonic()
            except Exception as exc:
                log.warning("%s: step stats not published (%r)", self.instance_id, exc)

    def _stats(self) -> StepStats:
        """The window of steps, the budgets in force and the CPU time the host and this process took."""
        s, cpu = self.engine.stats, self.cpu
        busy, own = cpu.counters()
        return StepStats(
            instance_id=self.instance_id,
            roles=tuple(sorted(self.roles)),
            profile_id=self.profile_id,
            time=time.time(),
            image_budget=s.image_budget,
            token_budget=s.token_budget,
            budget_scale=s.budget_scale,
            steps=self.steps.window(),
            host=cpu.host if busy else "",
            host_cores=cpu.cores,
            host_cpu_seconds=round(busy, 3),
            process_cpu_seconds=round(own, 3),
        )
