"""Request-record writes off the request's critical path.

Each write is a Redis round trip; awaited inline, the marks of one hand-off add up to
milliseconds of TTFT. Writes are queued with the time they describe and made by one task the
owning service runs; `flush()` empties the queue before shutdown. The task takes what has queued
up (at most BATCH writes) and makes each request's writes in order, up to WRITERS requests' at
once (bench/recorder.py: 1.7× the writes per second of one at a time). One at a time, a gateway
at 60 req/s on two busy cores fell more than 5 s behind, and its requests were traced without
the outcome the client saw.

The trace entry of a request needs the worker's end mark, the gateway's outcome and (where it
made tokens) prefill's first-token mark; whichever comes last appends it. A worker that marks an
end also keeps the request for `trace_grace` seconds and then appends the entry itself if it is
still missing (the gateway died, or its client left): every finished request is traced, exactly
once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from common.aio import raise_if_cancelled
from common.store.requests import Stage

if TYPE_CHECKING:
    from common.store import Store

log = logging.getLogger(__name__)
# Seconds the gateway has to report an outcome after a request's end. A gateway on saturated
# cores fell more than 5 s behind; a dead gateway's requests are traced this much later.
TRACE_GRACE = 30.0
BATCH = 256  # queued writes taken at once
WRITERS = 16  # requests whose writes are made at once (each holds a pooled connection meanwhile)


class StageRecorder:
    def __init__(
        self, store: Store, trace_grace: float = TRACE_GRACE, writers: int = WRITERS, batch: int = BATCH
    ) -> None:
        """`writers`, `batch`: WRITERS and BATCH (bench/recorder.py compares 1 and 1, one at a time)."""
        self.store = store
        self.trace_grace = trace_grace
        self.writers = writers
        self.batch = batch
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()
        self._unreported: deque[tuple[float, str]] = deque()  # (due, request id), due ascending
        self.failures = 0

    def create(self, request_id: str, **sizes: float) -> None:
        """The request's record, at the gateway: its arrival and sizes (RequestLog.create)."""
        self._queue.put_nowait(("create", request_id, sizes))

    def mark(self, request_id: str, stage: Stage, at: float | None = None, **info: str) -> None:
        """Set a stage's time (`at`, wall clock; default now) and optional facts about it."""
        self._queue.put_nowait(("mark", request_id, stage, time.time() if at is None else at, info))

    def finish(self, request_id: str, output_tokens: int, finish_reason: str, cached_tokens: int = 0) -> None:
        """The request's end, at the worker that made its last token, with the prompt tokens the
        prefill found cached."""
        self._queue.put_nowait(
            ("finish", request_id, output_tokens, finish_reason, time.time(), cached_tokens)
        )

    def outcome(self, request_id: str, ttft: float, tbt_p90: float | None, slo_met: bool) -> None:
        self._queue.put_nowait(("outcome", request_id, ttft, tbt_p90, slo_met))

    async def run(self) -> None:
        while True:
            raise_if_cancelled()
            wait = self._unreported[0][0] - time.monotonic() if self._unreported else None
            try:
                # Not wait_for: on 3.11 it drops a cancel that lands as the item arrives, and a
                # task group stopping this task would then wait for it forever.
                async with asyncio.timeout(wait):
                    item = await self._queue.get()
            except TimeoutError:
                await self._trace_unreported(time.monotonic())
                continue
            batch = [item]
            while len(batch) < self.batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._write_all(batch)
            for _ in batch:
                self._queue.task_done()

    async def flush(self, timeout: float = 5.0) -> None:
        """Write what is queued, and trace now the requests still waiting for an outcome."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            await asyncio.wait_for(self._trace_unreported(float("inf")), timeout)
        except TimeoutError:
            log.warning("%d request-record writes not flushed", self._queue.qsize() + len(self._unreported))

    async def _trace_unreported(self, now: float) -> None:
        while self._unreported and self._unreported[0][0] <= now:
            _, rid = self._unreported.popleft()
            await self._guarded(self.store.requests.append_trace(rid))

    async def _write_all(self, items: list[tuple]) -> None:
        """Each request's writes in the order queued; different requests' concurrently."""
        by_request: dict[str, list[tuple]] = {}
        for item in items:
            by_request.setdefault(item[1], []).append(item)
        groups = iter(by_request.values())

        async def writer() -> None:
            for group in groups:  # shared: each writer takes the next request's writes
                for item in group:
                    await self._write(item)

        await asyncio.gather(*(writer() for _ in range(min(self.writers, len(by_request)))))

    async def _write(self, item: tuple) -> None:
        requests = self.store.requests
        match item:
            case ("create", rid, sizes):
                await self._guarded(requests.create(rid, **sizes))
            case ("mark", rid, stage, at, info):
                await self._guarded(requests.mark(rid, stage, at=at, **info))
            case ("finish", rid, tokens, reason, at, cached):
                ended = requests.finish(
                    rid, output_tokens=tokens, finish_reason=reason, at=at, cached_tokens=cached
                )
                if await self._guarded(ended):
                    self._unreported.append((time.monotonic() + self.trace_grace, rid))
            case ("outcome", rid, ttft, tbt_p90, slo_met):
                await self._guarded(requests.outcome(rid, ttft=ttft, tbt_p90=tbt_p90, slo_met=slo_met))

    async def _guarded(self, write):
        try:
            return await write
        except Exception as exc:  # metadata only: a Redis outage must not fail requests
            self.failures += 1
            log.warning("request record write failed: %r", exc)
            return None
