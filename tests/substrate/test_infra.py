"""Local start-up of nats-server and redis-server: auth, payload limit, restart on the same port."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.infra import NatsServer, RedisServer, nats_server_binary
from tests.substrate.helpers import run

pytestmark = pytest.mark.timeout(60)


def test_nats_server_binary_comes_from_the_wheel() -> None:
    assert nats_server_binary().endswith("nats-server")


@pytest.mark.parametrize("auth", [{"token": "t0ken"}, {"user": "svc", "password": "pw"}])
def test_nats_auth_and_raised_max_payload(
    tmp_path_factory: pytest.TempPathFactory, auth: dict[str, str]
) -> None:
    with NatsServer(workdir=tmp_path_factory.mktemp("nats-auth"), **auth) as server:

        async def main() -> None:
            nc = await nats.connect(server.url)
            inbox = await nc.subscribe("big")
            payload = b"x" * (5 * 1024 * 1024)  # above NATS's 1 MB default
            await nc.publish("big", payload)
            assert (await inbox.next_msg(timeout=5)).data == payload
            await nc.close()
            with pytest.raises((nats.errors.Error, OSError)):
                await nats.connect(
                    f"nats://{server.host}:{server.port}", allow_reconnect=False, connect_timeout=2
                )

        run(main())


def test_nats_jetstream_store_survives_a_restart_on_the_same_port(nats_server: NatsServer) -> None:
    port = nats_server.port

    async def put() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep"])
        await js.publish("keep", b"payload")
        await nc.close()

    async def get() -> bytes:
        nc = await nats.connect(nats_server.url)
        msg = await nc.jetstream().get_msg("KEEP", 1)
        await nc.close()
        return msg.data or b""

    run(put())
    nats_server.restart()
    assert nats_server.port == port and nats_server.running
    assert run(get()) == b"payload"
    nats_server.stop()
    assert not nats_server.running


def test_redis_password_and_clean_stop(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = RedisServer(workdir=tmp_path_factory.mktemp("redis-pw"), password="pw")
    with server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0)).ping()
        proc = server._proc
    assert proc is not None and proc.returncode == 0  # SIGTERM: a clean exit, not a kill


def test_servers_start_quickly_side_by_side() -> None:
    async def main() -> None:
        servers = [NatsServer(), RedisServer(), NatsServer(), RedisServer()]
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
        assert len({s.port for s in servers}) == 4  # each on its own free port
        await asyncio.gather(*(asyncio.to_thread(s.close) for s in servers))
        assert not any(s.workdir.exists() for s in servers)  # a work dir it made itself is removed

    run(main())
