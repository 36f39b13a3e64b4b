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
import hashlib
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from PIL import Image

from common.planner.trace import TraceEntry
from trident.bench.clips import clip_data_url
from trident.bench.metrics import RequestResult
from trident.bench.repeat import ImageSeed, Repeats

TIMEOUT = 600.0  # seconds a request may take, its whole stream included, unless the caller says
_TEXT = "the cat sat on a red mat near the old blue door while small birds sang in tall green trees"
DEFAULT_IMAGE_SIZE = (640, 480)
DEFAULT_CLIP = (8.0, 640, 360)  # (seconds, width, height) of a clip a trace gives no size for


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
    repeats: Repeats = field(default_factory=Repeats)  # what the requests share (trident/bench/repeat.py)
    keep_bodies: bool = False  # keep each body sent on its result, for trident/bench/reuse.py


def image_data_url(seed: ImageSeed, size: tuple[int, int]) -> str:
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


def user_content(
    entry: TraceEntry, seed: int, opts: RequestOptions, num_images: int | None = None, clips: bool = True
) -> list[dict]:
    """A user message's parts: `num_images` images (default: the entry's), with `clips` the entry's
    video clips (real H.264 files, trident/bench/clips.py), then its text. An image is the
    request's own or, with an image pool, drawn from it (at one size, so it is the same)."""
    draws = np.random.default_rng([opts.repeats.seed, seed])
    sizes = list(entry.image_sizes or (DEFAULT_IMAGE_SIZE,) * entry.num_images)
    if num_images is not None:
        sizes = (sizes + [DEFAULT_IMAGE_SIZE] * num_images)[:num_images]
    parts: list[dict] = []
    for k, size in enumerate(sizes):
        image = opts.repeats.image_seed(seed * 64 + k, draws)
        size = opts.image_size or (size if isinstance(image, int) else DEFAULT_IMAGE_SIZE)
        parts.append({"type": "image_url", "image_url": {"url": image_data_url(image, size)}})
    specs = (entry.clips or (DEFAULT_CLIP,) * entry.num_videos) if clips else ()
    for k, (seconds, width, height) in enumerate(specs):
        url = clip_data_url(seconds, (width, height), seed * 64 + 32 + k)
        parts.append({"type": "video_url", "video_url": {"url": url}})
    parts.append({"type": "text", "text": prompt_text(entry, seed)})
    return parts


def request_body(messages: list[dict], max_tokens: int, opts: RequestOptions) -> dict:
    """A streamed chat request; the shared system prompt (if any) first."""
    if system := opts.repeats.system_prompt():
        messages = [{"role": "system", "content": system}, *messages]
    body = {
        "model": opts.model,
        "messages": messages,
        "max_tokens": max(1, max_tokens),
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body = opts.fix_length(body) if opts.fix_length else {**body, "ignore_eos": True}
    return body


def chat_body(entry: TraceEntry, index: int, opts: RequestOptions) -> dict:
    seed = opts.seed * 1_000_003 + index
    messages = [{"role": "user", "content": user_content(entry, seed, opts)}]
    return request_body(messages, entry.output_tokens, opts)


@dataclass(frozen=True)
class _Session:
    """What every request of one run shares: the client, the endpoint, the run's start (requests'
    times count from it), and who is told of each result."""

    client: httpx.AsyncClient
    url: str
    start: float  # time.perf_counter()
    on_done: Callable[[RequestResult], None] | None = None

    def done(self, result: RequestResult) -> None:
        if self.on_done is not None:
            self.on_done(result)


async def _one(
    session: _Session, body: dict, result: RequestResult, answer: list[str] | None = None
) -> RequestResult:
    """Send `body` at its scheduled time and time its stream; the text streamed goes to `answer`."""
    start = session.start
    await asyncio.sleep(max(0.0, start + result.scheduled - time.perf_counter()))
    result.images = [image_digest(url) for url in image_urls(body)]
    sent = time.perf_counter()
    result.sent = sent - start
    last = None
    try:
        async with session.client.stream("POST", session.url, json=body) as response:
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
                result.request_id = result.request_id or chunk.get("id") or ""
                if "error" in chunk:
                    result.error = f"stream error: {_message(data)}"
                    return result
                now = time.perf_counter()
                texts = [(c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()]
                if answer is not None:
                    answer.extend(t for t in texts if t)
                if any(texts):
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.tbts.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
        result.e2e = time.perf_counter() - sent
        result.ok = last is not None or result.output_tokens == 0
        if not result.ok:
            result.error = "empty: the stream ended without text"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def image_digest(url: str) -> str:
    """A short name for an image as sent (equal URLs: the same image), to count distinct ones."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def image_urls(body: dict) -> list[str]:
    """The image URLs of a chat request body, in prompt order."""
    return [
        part["image_url"]["url"]
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


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
    timeout: float = TIMEOUT,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send `entries` at their arrival times to `base_url`/v1/chat/completions; one result each,
    in the entries' order, failures included (with `error` set). With `opts.repeats.turns` over 1,
    each entry starts a conversation instead (`conversation`): its turns' results, in order."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    bodies = []
    if not opts.repeats.multi_turn:
        bodies = await asyncio.to_thread(lambda: [chat_body(e, i, opts) for i, e in enumerate(entries)])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        session = _Session(client, url, time.perf_counter() + 0.2, on_done)

        async def one(i: int, e: TraceEntry) -> list[RequestResult]:
            if opts.repeats.multi_turn:
                return await conversation(session, e, i, opts)
            r = RequestResult(index=i, scheduled=e.arrival, num_images=e.num_images)
            r.body = bodies[i] if opts.keep_bodies else None
            r = await _one(session, bodies[i], r)
            session.done(r)
            return [r]

        done = await asyncio.gather(*(one(i, e) for i, e in enumerate(entries)))
    return [r for results in done for r in results]


def turn_messages(history: list[tuple[list[dict], str]], parts: list[dict], image_window: int) -> list[dict]:
    """A turn's messages: each earlier turn's user message and answer, then this turn's `parts`. The
    images and clips of turns older than the latest `image_window` (this one included) are left
    out; 0 keeps them all."""
    messages: list[dict] = []
    for age, (past, answer) in enumerate(history[::-1], start=1):
        keep_images = not image_window or age < image_window
        resent = past if keep_images else [p for p in past if p["type"] not in ("image_url", "video_url")]
        messages[:0] = [{"role": "user", "content": resent}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": parts}]


async def conversation(
    session: _Session, entry: TraceEntry, index: int, opts: RequestOptions
) -> list[RequestResult]:
    """One user's `opts.repeats.turns` turns, the first at the entry's arrival, each later one a
    think time after the answer before it. Every turn resends the history (its answers as they
    streamed) and adds its own message: the entry's images on the first turn, an image with
    probability `image_prob` on each later one, and the entry's text. Images older than the last
    `image_window` turns are left out of what is resent. A turn that fails ends the conversation:
    the turns after it are recorded as not sent."""
    repeats = opts.repeats
    draws = np.random.default_rng([repeats.seed, opts.seed, index, 0xC0])
    history: list[tuple[list[dict], str]] = []  # (user parts, answer) per finished turn
    results: list[RequestResult] = []
    due = entry.arrival
    for turn in range(repeats.turns):
        seed = (opts.seed * 1_000_003 + index) * 1_000 + turn
        images = entry.num_images if turn == 0 else int(draws.random() < repeats.image_prob)
        parts = await asyncio.to_thread(user_content, entry, seed, opts, images, turn == 0)
        messages = turn_messages(history, parts, repeats.image_window)
        result = RequestResult(
            index=index * repeats.turns + turn, scheduled=due, num_images=images, turn=turn
        )
        answer: list[str] = []
        body = request_body(messages, entry.output_tokens, opts)
        result.body = body if opts.keep_bodies else None
        await _one(session, body, result, answer)
        results.append(result)
        session.done(result)
        if not result.ok:
            break
        history.append((parts, "".join(answer)))
        due = time.perf_counter() - session.start + repeats.think(draws)
    for turn in range(len(results), repeats.turns):
        skipped = RequestResult(index=index * repeats.turns + turn, scheduled=due, turn=turn)
        skipped.error = "not sent: an earlier turn of its conversation failed"
        results.append(skipped)
        session.done(skipped)
    return results


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
