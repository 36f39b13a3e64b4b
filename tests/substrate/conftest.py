"""Fixtures for the substrate tests: a real nats-server and a real redis-server per test.

Each test gets fresh servers (they start in ~0.1 s), so a test that restarts or kills one
cannot disturb another. There is no pytest-asyncio here: tests drive coroutines with
`helpers.run()`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from common.infra import NatsServer, RedisServer


@pytest.fixture(autouse=True)
def _quiet_clients(caplog: pytest.LogCaptureFixture) -> None:
    # NATS and UCX log every refused reconnect while a server restarts; keep the output readable.
    caplog.set_level(logging.INFO, logger="common")
    logging.getLogger("nats").setLevel(logging.CRITICAL)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(workdir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server
