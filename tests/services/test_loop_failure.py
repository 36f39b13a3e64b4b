"""A loop that raises inside a running worker or gateway takes that process down loudly: the
failure is logged with the loop's name, the process exits with EXIT_LOOP_FAILED, and it stops
answering — it never serves on half-alive. The fault is injected through the runtime's test-only
hook (TRIDENT_TEST_FAULT names the loops, SIGUSR1 trips them; common/runtime/supervisor.py)."""

from __future__ import annotations

import signal
import time

import httpx

from common.runtime import EXIT_LOOP_FAILED, FAULT_ENV
from tests.deploy import running_cluster
from tests.helpers.chat import client_for

EXIT_WAIT = 60.0  # seconds a process may take to close and exit on this loaded machine


def _wait_for(ok, timeout: float = EXIT_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _ready(url: str) -> int | None:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_a_failed_loop_ends_the_worker_then_the_gateway(tiny_model_dir, tmp_path) -> None:
    env = {FAULT_ENV: "housekeeping,queues"}  # a worker's upkeep, the gateway's queue watch
    with running_cluster(tiny_model_dir, tmp_path, "epd", env=env) as c:
        client = client_for(c)
        served = client.completions.create(model="tiny-llava", prompt="hello", max_tokens=2)
        assert served.choices[0].text is not None

        (name,) = [n for n in c.procs if n != "gateway"]
        worker = c.procs[name]
        worker.send_signal(signal.SIGUSR1)
        assert worker.wait(EXIT_WAIT) == EXIT_LOOP_FAILED
        log = c.log(name)
        assert "loop housekeeping failed (InjectedFault" in log, log[-2000:]
        assert "exits: loop housekeeping failed" in log
        # Gone from the deployment: the gateway no longer counts its roles as live.
        _wait_for(lambda: _ready(c.url) == 503)

        gateway = c.procs["gateway"]
        gateway.send_signal(signal.SIGUSR1)
        assert gateway.wait(EXIT_WAIT) == EXIT_LOOP_FAILED
        log = c.log("gateway")
        assert "loop queues failed (InjectedFault" in log, log[-2000:]
        assert _ready(c.url) is None  # nothing answers on its port any more
