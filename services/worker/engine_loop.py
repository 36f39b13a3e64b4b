"""Runs an Engine on a thread of its own, so model steps never block the event loop.

Everything that touches the engine — admitting, aborting, exporting KV, stepping — runs on that
thread, between steps, so the engine needs no locks. The asyncio side submits calls and awaits
their results, and receives each step's outputs through a callback on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from common.engine import Engine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    def __init__(self, engine: Engine, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._calls: queue.Queue[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop] | None]
        self._calls = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: BaseException | None = None
        self.steps = 0
        self.stats: dict[str, int] = {}
        self._snapshot()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        if self.failure is not None:
            raise RuntimeError("the engine thread has failed") from self.failure
        fut = asyncio.get_running_loop().create_future()
        self._calls.put((fn, fut, asyncio.get_running_loop()))
        return await fut

    async def stop(self) -> None:
        self._calls.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                if not self._drain_calls(block=idle):
                    return
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self.steps += 1
                    if outputs:
                        self._loop.call_soon_threadsafe(self._on_outputs, outputs)
                self._snapshot()
        except BaseException as exc:  # surfaced to every later call and to the health check
            log.exception("engine thread failed")
            self.failure = exc

    def _snapshot(self) -> None:
        """Load figures for heartbeats and pull decisions; replaced whole, so readers need no lock."""
        e = self.engine
        self.stats = {
            "waiting": len(e.scheduler.waiting),
            "running": len(e.scheduler.running),
            "free_blocks": e.blocks.num_free,
            "handed_off": len(e.handed_off),
            "feature_hits": e.features.hits,
        }

    def _drain_calls(self, block: bool) -> bool:
        """Run queued calls; wait for one when idle. False once asked to stop."""
        while True:
            try:
                item = self._calls.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return True
            if item is None:
                return False
            fn, fut, loop = item
            try:
                result = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(_set, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_set, fut, result, None)
            block = False


def _set(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
