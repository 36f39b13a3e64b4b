"""The gateway's app served by uvicorn inside the test's own event loop (lifespan and all): what a
test that drives the gateway beside other in-process services (the planner) talks to over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn

from common.infra import free_port
from services.gateway.app import create_app
from services.settings import GatewaySettings


@contextlib.asynccontextmanager
async def gateway(settings: GatewaySettings) -> AsyncIterator[tuple[str, object]]:
    """Yield the gateway's URL and its Gateway object, started; stopped on the way out."""
    port = free_port()
    app = create_app(settings.model_copy(update={"port": port, "http_port": port}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not server.started:
                if task.done():
                    task.result()  # it failed to start: say why
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}", app.state.gateway
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
