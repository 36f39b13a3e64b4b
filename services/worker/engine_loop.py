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
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from common.engine import Engine, RequestOutput
from common.engine.admission import Load
from common.engine.request import Status
from services.worker.cores import CoreBoard

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EngineStats:
    """The engine's load after its last step, for heartbeats, pull decisions and /metrics. Taken on
    the engine thread and replaced whole, so the event loop reads it without a lock."""

    waiting: int  # admitted, not yet scheduled
    running: int
    handed_off: int  # left for their next stage, KV kept until it is pulled
    free_blocks: int
    total_blocks: int
    image_budget: int  # τe in force (the governor may have scaled it)
    token_budget: int  # τt in force
    feature_hits: int
    budget_scale: float  # the governor's scale of the profiled budgets (1.0: as profiled)
    feature_cache_bytes: int
    feature_cache_capacity: int
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of them, found cached (not computed again)
    cached_blocks: int = 0  # KV blocks findable by their prefix key now
    prefix_evictions: int = 0  # cached blocks given up to an allocation, since start
    images_encoded: int = 0  # images the vision tower ran on, since start (feature-cache hits are not)
    decode_bucket_steps: int = 0  # decode steps run padded to a bucket (replayed graphs on CUDA)
    graph_capture_failures: int = 0  # buckets whose CUDA graph could not be captured

    def load(self) -> Load:
        """What a stage's pull rule reads (common/engine/admission.py)."""
        return Load(
            waiting=self.waiting,
            free_blocks=self.free_blocks,
            image_budget=self.image_budget,
            running=self.running,
            token_budget=self.token_budget,
        )

    @classmethod
    def of(cls, e: Engine) -> EngineStats:
        return cls(
            waiting=len(e.scheduler.waiting),
            running=len(e.scheduler.running),
            handed_off=sum(r.status == Status.HANDED_OFF for r in e.requests.values()),
            free_blocks=e.blocks.num_free,
            total_blocks=e.blocks.num_blocks,
            image_budget=e.scheduler.image_budget,
            token_budget=e.scheduler.token_budget,
            feature_hits=e.features.hits,
            budget_scale=e.governor.scale if e.governor is not None else 1.0,
            feature_cache_bytes=e.features.used_bytes,
            feature_cache_capacity=e.features.capacity_bytes,
            prefix_queried_tokens=e.blocks.queried_tokens,
            prefix_hit_tokens=e.blocks.hit_tokens,
            cached_blocks=e.blocks.num_cached,
            prefix_evictions=e.blocks.evictions,
            images_encoded=e.runner.images_encoded,
            decode_bucket_steps=e.runner.graphs.runs if e.runner.graphs else 0,
            graph_capture_failures=e.runner.graphs.capture_failures if e.runner.graphs else 0,
        )


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[RequestOutput]], None],
        cores: CoreBoard | None = None,
    ) -> None:
        self.engine = engine
        self.cores = cores  # with a core board, each step's torch threads follow the host's idle cores
        self._on_outputs = on_outputs
        self._calls: queue.Queue[tuple[Callable[[], Any], asyncio.Future | None, Any] | None]
        self._calls = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: BaseException | None = None
        self.steps = 0
        self.stats = EngineStats.of(engine)
        if cores is not None:
            cores.follow_by_layer(engine.model)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that awaits this engine's calls (set by `start`)."""
        if self._loop is None:
            raise RuntimeError("the engine loop has not started")
        return self._loop

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        if self.failure is not None:
            raise RuntimeError("the engine thread has failed") from self.failure
        fut = asyncio.get_running_loop().create_future()
        self._calls.put((fn, fut, asyncio.get_running_loop()))
        return await fut

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue `fn` for the engine thread without waiting for it: it runs after every call queued
        before it, and a failure is logged there. For releases whose order matters, not their result."""
        self._calls.put((fn, None, None))

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
                    outputs = self._step()
                    self.steps += 1
                    if outputs:
                        self._loop.call_soon_threadsafe(self._on_outputs, outputs)
                self.stats = EngineStats.of(self.engine)
        except BaseException as exc:  # surfaced to every later call and to the health check
            log.exception("engine thread failed")
            self.failure = exc

    def _step(self) -> list[RequestOutput]:
        if self.cores is None:
            return self.engine.step()
        threads = self.cores.begin_step()
        try:
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            return self.engine.step()
        finally:
            self.cores.end_step()

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
                if fut is None:
                    log.exception("engine call %r failed", fn)
                else:
                    loop.call_soon_threadsafe(_set, fut, None, exc)
            else:
                if fut is not None:
                    loop.call_soon_threadsafe(_set, fut, result, None)
            block = False


def _set(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
