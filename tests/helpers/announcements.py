"""What the instances of a running deployment announce of their prefix caches (PrefixBlocks on NATS),
heard from a test: on a deployment that other modules used before, the gateway's index is never
empty, and its size may even shrink while a test's keys arrive (an instance forgotten, a block
evicted), so a test that needs its own prompt indexed waits for the announcement that carries it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import nats

from common.bus.subjects import Subjects
from common.protocol import PrefixBlocks, decode
from tests.helpers.probes import wait_for


@dataclass(frozen=True)
class Heard:
    at: float  # time.monotonic() when it arrived
    instance_id: str
    snapshot: bool
    keys: int  # what it gained, or, a snapshot, all it holds


class Announcements:
    """Every announcement from the moment this starts listening (a context manager) until it ends."""

    def __init__(self, cluster) -> None:
        self.url = cluster.nats.url
        self.heard: list[Heard] = []
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)

    def __enter__(self) -> Announcements:
        self._thread.start()
        if not self._listening.wait(10):
            raise TimeoutError(f"could not subscribe to the prefix announcements on {self.url}")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    async def _listen(self) -> None:
        nc = await nats.connect(self.url, allow_reconnect=False)
        try:

            async def heard(msg) -> None:
                m = decode(msg.data, expect=PrefixBlocks)
                self.heard.append(Heard(time.monotonic(), m.instance_id, m.snapshot, len(m.gained)))

            await nc.subscribe(Subjects().prefix_blocks_all, cb=heard)
            await nc.flush()
            self._listening.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    def gained(self, instance_id: str, sent: float, answered: float) -> bool:
        """Whether `instance_id` has announced what a request sent at `sent` and answered at
        `answered` (monotonic times) made it cache: a delta with keys since the request was sent
        (nothing else runs meanwhile), or a snapshot since it was answered (a snapshot takes the
        changes pending, so no delta follows it)."""
        return any(
            h.instance_id == instance_id and h.keys and (h.at >= answered if h.snapshot else h.at >= sent)
            for h in list(self.heard)
        )

    def wait_gained(self, instance_id: str, sent: float, answered: float, what: str) -> None:
        wait_for(lambda: self.gained(instance_id, sent, answered), timeout=30, what=what)

    def wait_snapshot(self, instance_id: str, since: float, what: str) -> None:
        """Until `instance_id` announces everything it holds (a snapshot, every few seconds) after
        `since`: a gateway listening by then has heard it."""

        def found() -> bool:
            return any(
                h.instance_id == instance_id and h.snapshot and h.at >= since for h in list(self.heard)
            )

        wait_for(found, timeout=30, what=what)
