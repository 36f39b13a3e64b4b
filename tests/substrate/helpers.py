"""Helpers for the substrate tests: running coroutines, worker processes that can be killed, taking
tasks from a queue, and the transfer backends to run each case over."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import pytest

from common.bus import Bus, BusConfig, Task, TaskConsumer
from common.protocol import PrefillTask, RequestSpec
from common.transfer import ucx_available

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a test coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.1) -> bool:
    """Poll `check` until it is true or `timeout` passes; returns its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def prefill_task(request_id: str) -> PrefillTask:
    return PrefillTask(
        request=RequestSpec(request_id=request_id, prompt_token_ids=(1, 2, 3), arrival_time=time.time())
    )


def spawn(target: Callable[..., None], *args: Any) -> tuple[mp.process.BaseProcess, Connection]:
    """Start `target(*args, conn)` in a fresh interpreter; returns the process and our pipe end."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def fetch_and_hang(config: BusConfig, role: str, conn: Connection) -> None:
    """A worker that takes one task, reports its request id, and never acks (it gets SIGKILLed)."""

    async def main() -> None:
        bus = await Bus.connect(config)
        consumer = await bus.consumer(role)
        while True:
            tasks = await consumer.fetch(1, timeout=1.0)
            if tasks:
                rid = tasks[0].message.request.request_id  # type: ignore[attr-defined]
                await asyncio.to_thread(conn.send, rid)
                await asyncio.sleep(3600)

    asyncio.run(main())


def pull_forever(backend: str, address: str, handle: str, conn: Connection) -> None:
    """A puller that reports each completed pull; it gets SIGKILLed in the middle of one."""
    from common.transfer import TransferConfig, create_backend

    async def main() -> None:
        puller = create_backend(TransferConfig(backend=backend))  # type: ignore[arg-type]
        await puller.start()
        while True:
            pulled = await puller.pull(address, handle)
            pulled.release()
            await asyncio.to_thread(conn.send, "pulled")

    asyncio.run(main())


async def take(consumer: TaskConsumer, n: int, ack: bool, within: float = 10.0) -> list[Task]:
    """`n` distinct tasks, acked as they come or held. A fetch returns *up to* what it asks for
    (under load, fewer), so ask again for the rest, within a bound; a held task that comes back
    meanwhile (its ack wait lapsed) is taken once. A fetch can also bring more than it asked for (a
    late message of an earlier fetch that timed out): what is past `n` goes back to the queue."""
    got: dict[str, Task] = {}
    deadline = time.monotonic() + within
    while len(got) < n and time.monotonic() < deadline:
        for task in await consumer.fetch(n - len(got), timeout=1.0):
            rid = task.message.request.request_id
            if rid not in got and len(got) >= n:
                await task.nak()
                continue
            if ack:
                assert await task.ack()
            got.setdefault(rid, task)
    return list(got.values())


# The transfer backends a test runs each of its cases over (UCX only where ucxx loads).
BACKENDS = [
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not load here")),
    "tcp",
]
