"""How many tasks wait in each stage's queue, so the gateway stops accepting work the deployment
cannot start on: past `limit` undelivered tasks in any stage, new requests get 429."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Gauge

from common.aio import raise_if_cancelled
from common.bus import Bus
from common.roles import Role

log = logging.getLogger(__name__)


class QueueDepths:
    def __init__(self, bus: Bus, limit: int, gauge: Gauge, interval: float = 0.25) -> None:
        self.bus = bus
        self.limit = limit
        self.gauge = gauge  # trident_gateway_queued_tasks{stage}
        self.interval = interval
        self.depth: dict[Role, int] = dict.fromkeys(Role, 0)

    def full(self) -> Role | None:
        """A stage whose queue is at its limit, if any."""
        return next((role for role, n in self.depth.items() if n >= self.limit), None)

    async def run(self) -> None:
        """Read the queues every `interval`; while NATS is away, the last figures stand."""
        while True:
            raise_if_cancelled()
            for role in Role:
                try:
                    self.depth[role] = await self.bus.queued(role)
                    self.gauge.labels(role).set(self.depth[role])
                except Exception as exc:
                    log.debug("queue depth of %s unknown now: %r", role, exc)
            await asyncio.sleep(self.interval)
