"""Telling the cluster where prefixes live: the prefix-cache keys this instance gained and gave up,
every `interval` seconds, and all it holds every `snapshot_every` seconds (common/protocol
PrefixBlocks). Gateways index them to send a request to the instance that holds its prefix
(services/gateway/kv_routing.py). Core NATS, at most once: a lost delta leaves a gap in `seq`, which
the next snapshot closes, and a gateway started later learns everything from it."""

from __future__ import annotations

import asyncio
import logging
import time

from common.bus import Bus
from common.protocol import PrefixBlocks
from services.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)
INTERVAL = 0.25  # seconds between deltas
SNAPSHOT_EVERY = 5.0  # seconds between snapshots
KEYS_PER_MESSAGE = 8192  # 32-byte keys: ~270 KB a message, well under NATS's 1 MB payload limit


class PrefixAnnouncer:
    def __init__(
        self,
        instance_id: str,
        loop: EngineLoop,
        bus: Bus,
        interval: float = INTERVAL,
        snapshot_every: float = SNAPSHOT_EVERY,
    ) -> None:
        self.instance_id = instance_id
        self.loop = loop
        self.bus = bus
        self.interval = interval
        self.snapshot_every = snapshot_every
        self.seq = 0
        self.sent = 0  # messages published (metrics, tests)

    async def run(self) -> None:
        blocks = self.loop.engine.blocks
        await self.loop.call(blocks.watch_changes)
        last_snapshot = float("-inf")
        while True:
            try:
                if time.monotonic() - last_snapshot >= self.snapshot_every:
                    last_snapshot = time.monotonic()
                    await self._snapshot(blocks)
                else:
                    gained, dropped = await self.loop.call(blocks.take_changes)
                    await self._delta(blocks.block_size, gained, dropped)
            except Exception as exc:  # NATS away: the next snapshot says it all again
                log.debug("%s: prefix keys not announced (%r)", self.instance_id, exc)
                last_snapshot = float("-inf")
            await asyncio.sleep(self.interval)

    async def _snapshot(self, blocks) -> None:
        def everything() -> list[bytes]:  # on the engine thread: no change falls between the two
            blocks.take_changes()
            return blocks.cached_hashes()

        keys = await self.loop.call(everything)
        chunks = [keys[i : i + KEYS_PER_MESSAGE] for i in range(0, len(keys), KEYS_PER_MESSAGE)] or [[]]
        self.seq += 1
        for part, chunk in enumerate(chunks):
            await self._publish(
                seq=self.seq,
                block_size=blocks.block_size,
                snapshot=True,
                part=part,
                parts=len(chunks),
                gained=tuple(chunk),
            )

    async def _delta(self, block_size: int, gained: list[bytes], dropped: list[bytes]) -> None:
        while gained or dropped:
            g, gained = gained[:KEYS_PER_MESSAGE], gained[KEYS_PER_MESSAGE:]
            d, dropped = dropped[: KEYS_PER_MESSAGE - len(g)], dropped[KEYS_PER_MESSAGE - len(g) :]
            self.seq += 1
            await self._publish(seq=self.seq, block_size=block_size, gained=tuple(g), dropped=tuple(d))

    async def _publish(self, **fields) -> None:
        await self.bus.events.prefix_blocks(PrefixBlocks(instance_id=self.instance_id, **fields))
        self.sent += 1
