"""Process entry: settings from the environment, the worker, its HTTP port, signals that drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Iterator

import uvicorn

from common.roles import parse_roles
from common.runtime import EXIT_LOOP_FAILED
from common.tls import Tls
from services.settings import WorkerSettings
from services.worker.engine_settings import engine_roles
from services.worker.http import make_app
from services.worker.instance import Stages, WorkerInstance, advertise_host

log = logging.getLogger(__name__)


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


def https_options(tls: Tls | None) -> dict[str, object]:
    """uvicorn's TLS: with the deployment's certificates, only a client showing one the CA signed
    is answered (its health, readiness and metrics included: probes run with the certificate)."""
    if tls is None:
        return {}
    return {
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_ca_certs": tls.ca,
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }


FENCED_EXIT = 3  # taken for dead while it lived (frozen, cut off): restart it as a new instance


async def serve(settings: WorkerSettings, stages: Stages) -> int:
    """Run a worker until it stops; returns the process's exit status: 0 after a drain,
    FENCED_EXIT when taken for dead, EXIT_LOOP_FAILED when one of its loops failed."""
    sock = bind(settings.bind_host, settings.http_port)
    scheme = "http" if settings.tls is None else "https"
    http_address = f"{scheme}://{advertise_host(settings.advertise_host)}:{sock.getsockname()[1]}"
    worker = await WorkerInstance.build(settings, stages, http_address)
    server = HttpServer(
        uvicorn.Config(make_app(worker), log_level="warning", lifespan="off", **https_options(settings.tls))
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain)
    worker.start()
    worker.runtime.supervise(
        "http", lambda: server.serve(sockets=[sock]), stop=lambda: setattr(server, "should_exit", True)
    )
    log.info("%s http %s", worker.instance_id, http_address)
    print(f"worker {worker.instance_id} http {http_address}", flush=True)
    failure = await worker.runtime.wait()
    await worker.close()
    if failure is not None:
        log.critical("%s exits: %s", worker.instance_id, failure)
        return EXIT_LOOP_FAILED
    log.info("%s stopped", worker.instance_id)
    return FENCED_EXIT if worker.ctx.fenced.is_set() else 0


def main(stages: Stages, roles: str | None = None) -> None:
    """Run a worker with the handlers in `stages` (composed outside this package: services/stages.py,
    or a stage's own entry point). `roles` fixes the role set (the single-role entry points);
    otherwise `--roles` or TRIDENT_ROLES."""
    parser = argparse.ArgumentParser(description="A Trident stage worker; settings from TRIDENT_* env vars.")
    if roles is None:
        parser.add_argument("--roles", help="subset of encode,prefill,decode (default: TRIDENT_ROLES)")
    args = parser.parse_args()
    chosen = roles or getattr(args, "roles", None)
    settings = WorkerSettings(**({"roles": chosen} if chosen else {}))
    missing = engine_roles(settings, parse_roles(settings.roles)) - stages.keys()
    if missing:
        parser.error(f"no stage handler for {', '.join(sorted(missing))} in this entry point")
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(serve(settings, stages)))
