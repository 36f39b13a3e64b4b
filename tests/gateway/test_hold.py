"""A request for a stage no live instance runs (scaled to zero, or its first instance still loading)
is held at the gateway, a bounded number at once and for a bounded time, then answered with a 503
that says what it waited for. Real NATS and Redis, the gateway in process; no worker runs. The
request that goes through once an instance registers: tests/kubernetes/test_method_change.py."""

from __future__ import annotations

import asyncio
import time

import httpx

from services.settings import GatewaySettings
from tests.gateway.in_process import gateway

BODY = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_request_with_no_instance_is_held_then_told_why(nats_server, redis_server, tiny_model_dir) -> None:
    settings = GatewaySettings(
        model=tiny_model_dir,
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        hold_timeout=2.0,
        max_held=1,
    )

    async def main() -> None:
        async with gateway(settings) as (url, gw), httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = time.monotonic()
            first = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
            async with asyncio.timeout(10):
                while gw.live_roles.held != 1:
                    await asyncio.sleep(0.02)
            metrics = (await http.get("/metrics")).text
            assert "trident_gateway_held_requests 1.0" in metrics
            # One held already, the most this gateway holds: the next is told at once.
            second = await http.post("/v1/chat/completions", json=BODY)
            assert second.status_code == 503 and time.monotonic() - started < 2.0
            error = second.json()["error"]
            assert error["code"] == "no_instance" and "TRIDENT_MAX_HELD" in error["message"]
            assert second.headers["retry-after"]
            reply = await first
            waited = time.monotonic() - started
            assert reply.status_code == 503 and 2.0 <= waited < 10, waited
            message = reply.json()["error"]["message"]
            assert "no live instance serves decode, prefill" in message and "after 2 s held" in message
            assert gw.live_roles.held == 0

    asyncio.run(main())
