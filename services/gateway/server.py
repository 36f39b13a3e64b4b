"""The gateway's HTTP server: uvicorn with h11, with the limits that keep a flood of connections
from starving well-behaved clients.

- A connection must send a request's line and headers within `header_timeout` of opening (or of
  its previous response): uvicorn alone waits for a first request forever, and its keep-alive
  timer is reset by every byte, so a client trickling header bytes could hold a socket for good.
- An idle keep-alive connection is closed after `keep_alive_timeout`.
- Headers may take at most h11's 16 KB (uvicorn's `h11_max_incomplete_event_size`); past it, 400.
- The body has its own deadline (door.py's `BodyReader`).
- The process's open-file limit is raised to its hard limit: every connection is a descriptor,
  and at the default soft limit (often 1024) a flood would stop `accept()` for everyone.

uvicorn's `limit_concurrency` is deliberately not used: past it, uvicorn answers 503 to every
new request, the well-behaved ones included, which is what a flood wants.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.settings import GatewaySettings

log = logging.getLogger(__name__)


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all arrived
    `header_timeout` seconds after it opened or after its last response."""

    class HeaderDeadline(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:  # waiting for the next request's headers
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("open-file limit stays at %d: %s", soft, exc)
    return soft


def serve(app: FastAPI, settings: GatewaySettings) -> None:
    """Serve `app` until SIGTERM/SIGINT, with the connection limits above."""
    raise_open_file_limit()
    uvicorn.run(
        app,
        host=settings.bind_host,
        port=settings.port,
        log_level="warning",
        http=header_deadline_protocol(settings.header_timeout),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type] - a float works
    )
