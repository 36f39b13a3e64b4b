"""Fixtures for the stage-handler tests: quiet NATS reconnects and the far side of a pull (the root
conftest gives each test its own nats-server and redis-server, and the HF oracle `hf_generate`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.stages.rig import ServingThread


@pytest.fixture(autouse=True)
def _quiet_nats() -> None:
    logging.getLogger("nats").setLevel(logging.CRITICAL)


@pytest.fixture
def owner() -> Iterator[ServingThread]:
    """A transfer server on a thread of its own, which a test can freeze: the gateway serving
    pixels, an encoder serving features, or any other owner a handler pulls from."""
    serving = ServingThread()
    serving.start()
    yield serving
    serving.close()
