"""The broker hop every disaggregated hand-off pays: a task published to JetStream until a worker in
another process holds it, for a worker with room for one task and for one with room for several.

    python bench/broker_hop.py [--tasks 200]

A worker with room for several asks for one task and then for those queued behind it; a lone
task must not wait for a batch that never comes (that wait was ~2.7 ms a hop). Tasks are sent
one at a time, each after the previous one arrived, so nothing queues. Prints a line per room
size and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from common.bus import Bus, BusConfig
from common.infra import NatsServer
from common.protocol import PrefillTask, RequestSpec


def worker(url: str, tasks: int, room: int, conn: Connection) -> None:
    """Fetch with `room`, report each task's arrival (wall clock), ack it."""

    async def main() -> None:
        bus = await Bus.connect(BusConfig(url=url, name="hop-worker"))
        consumer = await bus.consumer("prefill")
        conn.send("ready")
        got = 0
        while got < tasks:
            for task in await consumer.fetch(room, timeout=0.5):
                conn.send(time.time())
                await task.ack()
                got += 1
        await bus.close()

    asyncio.run(main())


async def publish(url: str, tasks: int, conn: Connection) -> list[float]:
    bus = await Bus.connect(BusConfig(url=url, name="hop-publisher"))
    hops = []
    for i in range(tasks):
        spec = RequestSpec(request_id=f"hop-{i}", prompt_token_ids=(1, 2, 3), arrival_time=time.time())
        sent = time.time()
        await bus.tasks.publish(PrefillTask(request=spec))
        hops.append((await asyncio.to_thread(conn.recv) - sent) * 1000)
        await asyncio.sleep(0.01)
    await bus.close()
    return hops


def measure(url: str, tasks: int, room: int) -> list[float]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(url, tasks, room, theirs), daemon=True)
    proc.start()
    if ours.recv() != "ready":
        raise RuntimeError("the worker did not start")
    hops = asyncio.run(publish(url, tasks, ours))
    proc.join(30)
    return hops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=200)
    args = ap.parse_args()
    summary = {"tasks": args.tasks}
    with tempfile.TemporaryDirectory(prefix="trident-hop-") as tmp, NatsServer(workdir=Path(tmp)) as nats:
        asyncio.run(_create_streams(nats.url))
        for room in (1, 8):
            hops = sorted(measure(nats.url, args.tasks, room))
            p50, p90 = statistics.median(hops), hops[int(0.9 * (len(hops) - 1))]
            print(f"room {room}: publish -> held by the worker p50 {p50:.2f} ms, p90 {p90:.2f} ms")
            summary[f"room{room}_p50_ms"] = round(p50, 3)
            summary[f"room{room}_p90_ms"] = round(p90, 3)
    print(json.dumps(summary))


async def _create_streams(url: str) -> None:
    bus = await Bus.connect(BusConfig(url=url, name="hop-setup"))
    await bus.close()


if __name__ == "__main__":
    main()
