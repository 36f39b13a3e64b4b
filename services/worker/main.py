"""Process entry: settings from the environment, the worker, its HTTP port, signals that drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from common.roles import Role
from services.decode.handler import DecodeHandler
from services.encoder.handler import EncodeHandler
from services.prefill.handler import PrefillHandler
from services.settings import WorkerSettings
from services.worker.http import make_app
from services.worker.worker import StageWorker, _Stopped

log = logging.getLogger(__name__)
# Each role's handler; a hybrid instance holds the handlers of all its roles.
STAGES = {Role.ENCODE: EncodeHandler, Role.PREFILL: PrefillHandler, Role.DECODE: DecodeHandler}


def bind(host: str, port: int) -> socket.socket:
    """A listening socket bound before uvicorn starts, so port 0's real port is known up front."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn with its signal handling left to the worker. Its own catches SIGTERM, stops serving at
    once and raises the signal again on the way out: health and metrics would vanish while the
    worker drains, and the drain would be asked for twice."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


FENCED_EXIT = 3  # taken for dead while it lived (frozen, cut off): restart it as a new instance


async def serve(settings: WorkerSettings) -> int:
    """Run a worker until it stops; returns the process's exit status."""
    worker = StageWorker(settings, STAGES)
    await worker.start()
    sock = bind(settings.bind_host, settings.http_port)
    worker.http_address = f"http://{worker.host}:{sock.getsockname()[1]}"
    server = HttpServer(uvicorn.Config(make_app(worker), log_level="warning", lifespan="off"))
    loop = asyncio.get_running_loop()
    drains: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if not drains:
            log.info("%s: %s, draining", worker.instance_id, sig.name)
            drains.append(asyncio.ensure_future(worker.drain()))
        else:  # a second signal: no more waiting, held tasks go back to the queue
            log.warning("%s: %s again, giving held tasks back now", worker.instance_id, sig.name)
            worker.hurry_drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("%s http %s", worker.instance_id, worker.http_address)
    print(f"worker {worker.instance_id} http {worker.http_address}", flush=True)
    http = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await worker.run()
    except* _Stopped:  # the task group's way of ending after a stop request
        pass
    finally:
        for task in drains:
            with contextlib.suppress(Exception):
                await task
        server.should_exit = True
        await http
        await worker.close()
        log.info("%s stopped", worker.instance_id)
    return FENCED_EXIT if worker.ctx.fenced.is_set() else 0


def main(roles: str | None = None) -> None:
    """`roles` fixes the role set (the single-role entry points); otherwise `--roles` or TRIDENT_ROLES."""
    parser = argparse.ArgumentParser(description="A Trident stage worker; settings from TRIDENT_* env vars.")
    if roles is None:
        parser.add_argument("--roles", help="subset of encode,prefill,decode (default: TRIDENT_ROLES)")
    args = parser.parse_args()
    chosen = roles or getattr(args, "roles", None)
    settings = WorkerSettings(**({"roles": chosen} if chosen else {}))
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(serve(settings)))
