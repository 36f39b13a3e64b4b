"""A substrate that survives losing a node (common/infra/ha.py), with real servers: a three-node
NATS cluster whose task stream keeps three copies, and Redis behind three sentinels.

- the node leading the task stream is killed: no task is lost, the clients carry on through the
  others, and the node, restarted, rejoins;
- the Redis primary is killed: the sentinels promote the replica, a Store client finds it and
  keeps what was written before, and the old primary, restarted, comes back as a replica.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis

from common.bus import Bus, BusConfig
from common.infra.ha import NatsCluster, RedisGroup
from common.store import Store, StoreConfig
from common.store.connect import sentinel_target, sync_client
from tests.substrate.helpers import prefill_task, run, take

pytestmark = pytest.mark.timeout(120)
LOOPBACK = ["127.0.0.1"] * 3


@pytest.mark.slow  # a failover waited out on the servers' own timers: `make test`, not the fast tier
def test_the_task_stream_keeps_every_task_when_its_leader_node_dies(tmp_path: Path) -> None:
    with NatsCluster(tmp_path, LOOPBACK, token="t0ken") as cluster:

        async def main() -> None:
            config = BusConfig(url=cluster.url, ack_wait=2.0, publish_timeout=30.0, stream_replicas=3)
            assert len(config.servers) == 3
            producer, worker = await Bus.connect(config), await Bus.connect(config)
            consumer = await worker.consumer("prefill")
            before = [f"a{i}" for i in range(20)]
            for rid in before:
                await producer.tasks.publish(prefill_task(rid))
            acked = {t.message.request.request_id for t in await take(consumer, 8, ack=True)}
            assert len(acked) == 8

            info = await producer.js.stream_info(config.subjects.task_stream)
            assert info.config.num_replicas == 3 and info.cluster is not None
            leader = next(n for n in cluster.nodes if n.name == info.cluster.leader)
            await asyncio.to_thread(leader.kill)

            after = [f"b{i}" for i in range(20)]  # published while a new leader is chosen
            for rid in after:
                await asyncio.wait_for(producer.tasks.publish(prefill_task(rid)), 30.0)
            expected = {*before, *after} - acked
            seen: set[str] = set()
            deadline = time.monotonic() + 40
            while seen != expected and time.monotonic() < deadline:
                for task in await consumer.fetch(8, timeout=1.0):
                    if await task.ack():
                        seen.add(task.message.request.request_id)
            assert seen == expected  # nothing lost, nothing acked redone
            await producer.close()
            await worker.close()

        run(main())
        leader_gone = next(n for n in cluster.nodes if not n.running)
        leader_gone.start()  # the same name and store: it rejoins as a follower
        deadline = time.monotonic() + 30
        while not cluster.settled() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.settled()


@pytest.mark.slow  # a failover waited out on the servers' own timers: `make test`, not the fast tier
def test_a_store_follows_the_primary_the_sentinels_promote(tmp_path: Path) -> None:
    with RedisGroup(tmp_path, LOOPBACK, password="s3cret") as group:
        assert sentinel_target(group.url) is not None
        assert "s3cret" in group.url and "s3cret" not in group.address
        first = group.primary_node()
        assert first is group.nodes[0]

        blocking = sync_client(group.url, timeout=1.0)  # the launcher's kind of client
        assert blocking.get("ha:none") is None  # connected to the first primary

        async def main() -> None:
            store = await Store.connect(StoreConfig(url=group.url, prefix="ha"))
            await store.redis.set("ha:before", "kept")
            await asyncio.to_thread(_wait_replicated, group, "ha:before")
            await asyncio.to_thread(first.kill)
            # Every write goes through: each retries until the sentinels name the replica.
            for i in range(30):
                await store.redis.set(f"ha:after:{i}", i)
                await asyncio.sleep(0.05)
            assert await store.redis.get("ha:before") == b"kept"
            await store.close()

        run(main())
        # The blocking client's connection died with the primary; its next reconnect finds the new one.
        deadline = time.monotonic() + 10
        while True:
            try:
                assert blocking.get("ha:before") == b"kept"
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the blocking client never found the promoted primary"
                time.sleep(0.2)
        blocking.close()
        promoted = group.primary_node()
        assert promoted is group.nodes[1]
        first.start()  # empty (no persistence): it must come back as the new primary's replica
        assert "--replicaof" in first.command
        assert first.command[first.command.index("--replicaof") + 2] == str(promoted.port)
        deadline = time.monotonic() + 20
        while not first.replicating() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.replicating() and group.primary_node() is promoted
    # The next deployment in the same folder starts empty: no copy of this one's data on disk.
    assert not list(tmp_path.glob("*/dump.rdb"))
    with RedisGroup(tmp_path, LOOPBACK, password="s3cret") as again:
        client = again.nodes[0]._client()
        try:
            assert client.dbsize() == 0
        finally:
            client.close()


def _wait_replicated(group: RedisGroup, key: str, timeout: float = 10.0) -> None:
    client = group.nodes[1]._client()
    try:
        deadline = time.monotonic() + timeout
        while client.get(key) is None:
            assert time.monotonic() < deadline, f"{key} never reached the replica"
            time.sleep(0.05)
    finally:
        client.close()
