"""Process entry: settings from the environment, the worker, its HTTP port, signals that drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys

import uvicorn

from services.settings import WorkerSettings
from services.worker.http import make_app
from services.worker.worker import StageWorker, _Stopped


def bind(host: str, port: int) -> socket.socket:
    """A listening socket bound before uvicorn starts, so port 0's real port is known up front."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


async def serve(settings: WorkerSettings) -> None:
    worker = StageWorker(settings)
    await worker.start()
    sock = bind(settings.bind_host, settings.http_port)
    worker.http_address = f"http://{worker.host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(make_app(worker), log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # ours drain first
    loop = asyncio.get_running_loop()
    drain_tasks: list[asyncio.Task] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: drain_tasks.append(asyncio.ensure_future(worker.drain())))
    logging.getLogger(__name__).info("%s http %s", worker.instance_id, worker.http_address)
    print(f"worker {worker.instance_id} http {worker.http_address}", flush=True)
    http = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await worker.run()
    except* _Stopped:  # the task group's way of ending after a stop request
        pass
    finally:
        for task in drain_tasks:
            with contextlib.suppress(Exception):
                await task
        server.should_exit = True
        await http
        await worker.close()


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
    asyncio.run(serve(settings))
