"""An open-loop client over the OpenAI chat API: every request goes out at its arrival time whether
or not earlier ones have answered (a closed loop would slow down with the server and hide queueing),
streams, and is timed chunk by chunk.

Request bodies are built before the clock starts (images are encoded then), so the client spends
the run sending and reading. Each image is distinct (no two requests share features, so a server's
feature cache cannot flatter it); its pixels are a smooth random pattern, which compresses like a
photograph rather than like noise.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from PIL import Image

from common.planner.trace import TraceEntry
from trident.bench.metrics import RequestResult

_TEXT = "the cat sat on a red mat near the old blue door while small birds sang in tall green trees"
DEFAULT_IMAGE_SIZE = (640, 480)


@dataclass(frozen=True)
class RequestOptions:
    model: str
    ignore_eos: bool = True  # fix output lengths at the trace's, as the papers do (vLLM's extension)
    temperature: float = 0.0
    image_size: tuple[int, int] | None = None  # None: each image's size from the trace
    seed: int = 0
    # How to ask this server for exactly max_tokens tokens, when it does not take `ignore_eos`
    # (e.g. deployments.Served.ignoring_eos); None: send `ignore_eos`.
    fix_length: Callable[[dict], dict] | None = None


def image_data_url(seed: int, size: tuple[int, int]) -> str:
    """A distinct JPEG of `size` pixels: a few random colours, smoothly interpolated."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    buf = io.BytesIO()
    coarse.resize(size, Image.Resampling.BICUBIC).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt_text(entry: TraceEntry, seed: int) -> str:
    """About `entry.text_tokens` tokens of text: common short words are one token each."""
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(_TEXT.split(), max(1, entry.text_tokens)))


def chat_body(entry: TraceEntry, index: int, opts: RequestOptions) -> dict:
    seed = opts.seed * 1_000_003 + index
    sizes = entry.image_sizes or (DEFAULT_IMAGE_SIZE,) * entry.num_images
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": image_data_url(seed * 64 + k, opts.image_size or s)}}
        for k, s in enumerate(sizes)
    ]
    parts.append({"type": "text", "text": prompt_text(entry, seed)})
    body = {
        "model": opts.model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": max(1, entry.output_tokens),
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body = opts.fix_length(body) if opts.fix_length else {**body, "ignore_eos": True}
    return body


async def _one(
    client: httpx.AsyncClient, url: str, body: dict, result: RequestResult, start: float
) -> RequestResult:
    await asyncio.sleep(max(0.0, start + result.scheduled - time.perf_counter()))
    sent = time.perf_counter()
    result.sent = sent - start
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"http {response.status_code}: {_message(text)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_message(data)}"
                    return result
                now = time.perf_counter()
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.tbts.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
        result.e2e = time.perf_counter() - sent
        result.ok = last is not None or result.output_tokens == 0
        if not result.ok:
            result.error = "empty: the stream ended without text"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"][:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


async def run(
    base_url: str,
    entries: Sequence[TraceEntry],
    opts: RequestOptions,
    *,
    api_key: str = "",
    timeout: float = 600.0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send `entries` at their arrival times to `base_url`/v1/chat/completions; one result each,
    in the entries' order, failures included (with `error` set)."""
    bodies = await asyncio.to_thread(lambda: [chat_body(e, i, opts) for i, e in enumerate(entries)])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        start = time.perf_counter() + 0.2

        async def one(i: int, e: TraceEntry) -> RequestResult:
            r = RequestResult(index=i, scheduled=e.arrival, num_images=e.num_images)
            r = await _one(client, base_url.rstrip("/") + "/v1/chat/completions", bodies[i], r, start)
            if on_done is not None:
                on_done(r)
            return r

        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(entries))))


async def served_model(base_url: str, api_key: str = "", timeout: float = 10.0) -> str:
    """The first model `GET /v1/models` lists: what to name in requests when none is given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
