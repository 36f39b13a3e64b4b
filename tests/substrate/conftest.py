"""Fixtures for the substrate tests (the per-test nats-server and redis-server are the root
conftest's). There is no pytest-asyncio here: tests drive coroutines with `helpers.run()`."""

from __future__ import annotations

import logging

import pytest

from common.transfer.testing import OwnerProcess
from tests.deploy import WARM


@pytest.fixture(autouse=True)
def _quiet_clients(caplog: pytest.LogCaptureFixture) -> None:
    # NATS and UCX log every refused reconnect while a server restarts; keep the output readable.
    caplog.set_level(logging.INFO, logger="common")
    logging.getLogger("nats").setLevel(logging.CRITICAL)


# Tensor owners, as the pullers (helpers.spawn), are forked from the suite's warm forkserver instead of
# spawned: each fresh interpreter imported torch again (about 2 s of CPU; some 45 per run).
OwnerProcess.context = WARM.context()
