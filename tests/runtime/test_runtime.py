"""The service runtime (common/runtime): loops under supervision and an ordered close, on a real
nats-server and redis-server. A loop that dies is never silently gone: the runtime says which and
why (what /health reports), and wakes whoever waits to take the service down."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from common.protocol import Heartbeat
from common.roles import Role
from common.runtime import EXIT_LOOP_FAILED, Runtime, Supervisor
from services.settings import ServiceSettings

WAIT = 10.0  # seconds any one event may take on a loaded machine


def settings(nats_server, redis_server) -> ServiceSettings:
    return ServiceSettings(nats_url=nats_server.address, redis_url=redis_server.address, namespace="rt")


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_loop_that_raises_fails_the_service(caplog) -> None:
    """The failure names the loop and the error, is logged with its traceback, and wakes wait();
    the other loops are stopped by stop(), the failed one's error reported once."""
    loops = Supervisor("svc-1")
    broken = asyncio.Event()

    async def breaks() -> None:
        await broken.wait()
        raise ValueError("the disk is full")

    loops.start("steady", forever)
    loops.start("fragile", breaks)
    broken.set()
    with caplog.at_level(logging.CRITICAL):
        failure = await asyncio.wait_for(loops.wait(), WAIT)
    assert failure is not None and failure.loop == "fragile"
    assert str(failure) == "loop fragile failed: ValueError: the disk is full"
    assert any(r.exc_info and "loop fragile failed" in r.getMessage() for r in caplog.records)
    assert loops.running() == ["steady"]
    await loops.stop()
    assert loops.running() == []


async def test_a_loop_that_returns_while_serving_is_a_failure_but_a_job_is_not() -> None:
    loops = Supervisor("svc-2")
    done = asyncio.Event()

    async def job() -> None:
        done.set()

    loops.start("drain", job, may_end=True)
    await asyncio.wait_for(done.wait(), WAIT)
    loops.start("watcher", lambda: asyncio.sleep(0))
    failure = await asyncio.wait_for(loops.wait(), WAIT)
    assert failure is not None and failure.loop == "watcher" and "returned" in failure.error
    await loops.stop()


async def test_a_stop_request_is_not_a_failure() -> None:
    loops = Supervisor("svc-3")
    loops.start("steady", forever)
    loops.request_stop()
    assert await asyncio.wait_for(loops.wait(), WAIT) is None
    await loops.stop()
    with pytest.raises(ValueError, match="runs already"):
        loops.start("twice", forever)
        loops.start("twice", forever)


async def test_runtime_reports_a_failed_loop_and_closes_in_order(nats_server, redis_server) -> None:
    """Heartbeats reach the registry while it runs; after a failed loop health() names it, and
    close() runs the service's closers, flushes the records and leaves the registry."""
    rt = await Runtime.connect(
        settings(nats_server, redis_server), "worker-rt-1", heartbeat_ttl=5.0, registered=True
    )
    order: list[str] = []

    async def closer() -> None:
        order.append("closer" if rt.bus.connected else "closer after the bus closed")

    rt.start(lambda: Heartbeat(instance_id="worker-rt-1", roles=(Role.DECODE,), time=time.time()))
    fail = asyncio.Event()

    async def fragile() -> None:
        await fail.wait()
        raise RuntimeError("boom")

    rt.supervise("fragile", fragile)
    deadline = asyncio.get_running_loop().time() + WAIT
    while "worker-rt-1" not in {hb.instance_id for hb in await rt.store.registry.instances()}:
        assert asyncio.get_running_loop().time() < deadline, "no heartbeat reached the registry"
        await asyncio.sleep(0.05)
    assert rt.health() is None
    fail.set()
    failure = await asyncio.wait_for(rt.wait(), WAIT)
    assert failure is not None and rt.health() == "loop fragile failed: RuntimeError: boom"
    store = rt.store
    await rt.close(closers=[closer])
    assert order == ["closer"]
    assert rt.loops.running() == []
    assert not rt.bus.connected
    # Left cleanly: a leaving beat and out of the registry (read with a fresh client).
    again = await Runtime.connect(settings(nats_server, redis_server), "reader-rt-1")
    try:
        assert "worker-rt-1" not in {hb.instance_id for hb in await again.store.registry.instances()}
    finally:
        await again.close()
    assert store is rt.store


async def test_exit_on_failure_closes_then_ends_the_process_with_its_status(
    nats_server, redis_server
) -> None:
    """An HTTP service's watcher: after a failed loop it closes, then ends the process with 70
    (here the exit is recorded instead: the real one is tests/services/test_loop_failure.py's)."""
    rt = await Runtime.connect(settings(nats_server, redis_server), "gateway-rt-2")
    rt.start(None)
    exits: list[tuple[int, bool]] = []

    async def fragile() -> None:
        raise RuntimeError("boom")

    rt.supervise("fragile", fragile)
    await asyncio.wait_for(rt.exit_on_failure(exit=lambda code: exits.append((code, rt.bus.connected))), WAIT)
    assert exits == [(EXIT_LOOP_FAILED, False)]
