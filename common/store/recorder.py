"""Request-record writes off the request's critical path.

Each stage mark is a Redis round trip; awaited inline, the marks of one hand-off add up to
milliseconds of TTFT. Marks are queued with the time they describe and written, in order, by
one task the worker owns; `flush()` empties the queue before shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.store import Stage, Store

log = logging.getLogger(__name__)


class StageRecorder:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()
        self.failures = 0

    def mark(self, request_id: str, stage: Stage, **info: str) -> None:
        self._queue.put_nowait(("mark", request_id, stage, time.time(), info))

    def finish(self, request_id: str, output_tokens: int, finish_reason: str) -> None:
        self._queue.put_nowait(("finish", request_id, output_tokens, finish_reason, time.time()))

    async def run(self) -> None:
        while True:
            await self._write(await self._queue.get())
            self._queue.task_done()

    async def flush(self, timeout: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except TimeoutError:
            log.warning("%d request-record writes not flushed", self._queue.qsize())

    async def _write(self, item: tuple) -> None:
        try:
            if item[0] == "mark":
                _, rid, stage, at, info = item
                await self.store.requests.mark(rid, stage, at=at, **info)
            else:
                _, rid, tokens, reason, at = item
                await self.store.requests.finish(rid, output_tokens=tokens, finish_reason=reason, at=at)
        except Exception as exc:  # metadata only: a Redis outage must not fail requests
            self.failures += 1
            log.warning("request record write failed: %r", exc)
