"""Helpers for the substrate tests: running coroutines, worker processes that can be killed, and taking
tasks from a queue. (Spawned pullers import this module first: it imports nothing that starts a thread.)"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from common.bus import Bus, BusConfig, Task, TaskConsumer
from common.protocol import PrefillTask, RequestSpec
from tests.deploy import WARM

T = TypeVar("T")
# Bound on waiting for a transfer owner to notice what a reader did or that it died (UCX: its
# liveness probe).
SETTLE = 5.0


def settles(check: Callable[[], bool], timeout: float = SETTLE) -> bool:
    """Whether `check` holds within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
    """Start `target(*args, conn)` in a process of its own, forked from the suite's warm forkserver
    (tests/deploy.py), which imported torch once; returns the process and our pipe end."""
    ctx = WARM.context()
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


def pull_forever(backend: str, address: str, handle: str, host_local: bool, conn: Connection) -> None:
    """A puller that reports each completed pull; it gets SIGKILLed in the middle of one."""
    from common.transfer import TransferConfig, create_backend

    async def main() -> None:
        puller = create_backend(TransferConfig(backend=backend, host_local=host_local))  # type: ignore[arg-type]
        await puller.start()
        while True:
            pulled = await puller.pull(address, handle)
            pulled.release()
            await asyncio.to_thread(conn.send, "pulled")

    asyncio.run(main())


def pull_and_hold(backend: str, address: str, handle: str, device: str | None, conn: Connection) -> None:
    """A same-host puller that says "mapped" once it has the owner's memory open, and then holds it,
    copying nothing, until it is SIGKILLed: the reader that dies at the worst moment."""
    import threading

    from common.transfer import TransferConfig, create_backend

    def hold() -> None:
        conn.send("mapped")
        threading.Event().wait()  # the copy never starts

    async def main() -> None:
        config = TransferConfig(backend=backend, timeout=600, device=device, host_local_cpu=True)  # type: ignore[arg-type]
        puller = create_backend(config)
        puller.on_mapped = hold
        await puller.start()
        await puller.pull(address, handle)

    asyncio.run(main())


def pull_unprivileged(backend: str, address: str, handle: str, conn: Connection) -> None:
    """A puller in a user namespace of its own (root there, not over the owner's): it may not open
    a non-dumpable owner's descriptors through /proc. Reports how its pull came and its bytes."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    import torch

    from common.transfer import TransferConfig, create_backend

    async def main() -> None:
        puller = create_backend(TransferConfig(backend=backend, timeout=30, host_local_cpu=True))  # type: ignore[arg-type]
        await puller.start()
        with await puller.pull(address, handle) as tensor:
            paths = {str(path): stats.pulls for path, stats in puller.stats.items()}
            paths["fallbacks"] = puller.host_local_fallbacks
            conn.send((paths, tensor.reshape(-1).view(torch.uint8).numpy().tobytes()))
        await puller.close()

    asyncio.run(main())


def pull_held_until_told(
    backend: str, address: str, handle: str, device: str | None, conn: Connection
) -> None:
    """A same-host puller that says "mapped" once it has the owner's memory open, waits for "go",
    then finishes its pull and reports how it ended: ("ok", path) or (error type, message). For a
    reader whose owner dies under it, in a process of its own (a GPU fault would end only it)."""
    from common.transfer import TransferConfig, create_backend

    def hold() -> None:
        conn.send("mapped")
        conn.recv()

    async def main() -> None:
        config = TransferConfig(backend=backend, timeout=20, device=device, host_local_cpu=True)  # type: ignore[arg-type]
        puller = create_backend(config)
        puller.on_mapped = hold
        await puller.start()
        try:
            pulled = await puller.pull(address, handle)
            conn.send(("ok", str(pulled.path)))
        except Exception as exc:
            conn.send((type(exc).__name__, str(exc)))

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
