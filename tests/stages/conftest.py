"""Fixtures for the stage-handler tests: real nats-server and redis-server per test, the HF oracle."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from common.infra import NatsServer, RedisServer
from tests.engine.conftest import hf_generate  # noqa: F401  (the oracle fixture, shared)


@pytest.fixture(autouse=True)
def _quiet_nats() -> None:
    logging.getLogger("nats").setLevel(logging.CRITICAL)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(workdir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server
