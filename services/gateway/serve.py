"""A completion request from validation to its reply: images fetched and decoded (preprocess.py),
the prompt processed, routed, and its outputs collected — all within the request's deadline."""

from __future__ import annotations

import asyncio
import time
import uuid

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from common.engine.admission import AdmissionError, check_fits
from common.engine.processor import InputError, ProcessedPrompt
from common.errors import APIError, clip
from common.protocol import Resend, SamplingParams
from common.protocol.sampling import choice_id
from common.video import VideoLimits
from services.gateway.api_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from services.gateway.choices import Choices
from services.gateway.collector import OutputCollector
from services.gateway.images import fetch_image
from services.gateway.preprocess import VideoSampling
from services.gateway.reply import Reply
from services.gateway.request_context import trace_of
from services.gateway.routing import route
from services.gateway.state import Gateway


def deadline_of(gw: Gateway, request: Request) -> float:
    """perf_counter time by which the request must have ended (it counts from its arrival)."""
    return getattr(request.state, "arrived", time.perf_counter()) + gw.settings.request_timeout


async def chat(gw: Gateway, body: ChatCompletionRequest, request: Request):
    deadline = deadline_of(gw, request)
    _check_model(gw, body.model)
    messages, urls = body.template_messages()
    if len(urls) > gw.images.max_images:
        raise APIError(400, f"at most {gw.images.max_images} images per request", param="messages")
    clips = body.video_urls()
    sampling = video_sampling(gw, body, len(clips)) if clips else None
    try:
        prompt = gw.processor.chat_prompt(messages)
    except TemplateError as exc:  # the checkpoint's template refuses them (its raise_exception)
        message = f"messages: the model's chat template refuses them: {clip(str(exc), 200)}"
        raise APIError(400, message, param="messages", code="chat_template") from None
    async with _within(deadline):
        if urls or clips:  # on the image threads (preprocess.py), never ahead of text-only requests
            blobs = await asyncio.gather(*(fetch_image(u, gw.images) for u in urls))
            videos = await asyncio.gather(*(fetch_image(u, gw.videos) for u in clips))
            processed = await gw.preprocess.process(prompt, blobs, videos, sampling)
            del blobs, videos
        else:
            processed = await gw.off_loop(_process, gw, prompt)
    return await serve(gw, request, body, processed, "chat", deadline)


def video_sampling(gw: Gateway, body: ChatCompletionRequest, clips: int) -> VideoSampling:
    """How the request's clips are sampled: what it asked (`mm_processor_kwargs`) within the
    server's caps, the server's defaults otherwise; a 400 naming what is out of bounds."""
    s = gw.settings
    if gw.processor.videos is None:
        raise APIError(
            400,
            f"the served model ({gw.processor.family}) takes no video; send images",
            param="messages",
            code="video_unsupported",
        )
    if clips > s.max_videos:
        raise APIError(400, f"at most {s.max_videos} videos per request", param="messages")
    asked = body.mm_processor_kwargs
    fps = asked.fps if asked and asked.fps is not None else s.video_fps
    frames = asked.max_frames if asked and asked.max_frames is not None else s.video_frames
    if fps > s.video_max_fps:
        raise APIError(400, f"fps may be at most {s.video_max_fps:g}", param="mm_processor_kwargs.fps")
    if frames > s.video_max_frames:
        raise APIError(
            400, f"max_frames may be at most {s.video_max_frames}", param="mm_processor_kwargs.max_frames"
        )
    limits = VideoLimits(
        max_bytes=s.max_video_bytes,
        max_duration_s=s.video_max_seconds,
        deadline_s=s.video_decode_timeout,
        max_fps=s.video_max_fps,
        max_frames=s.video_max_frames,
    )
    return VideoSampling(limits, fps, frames, gw.processor.videos.rule)


async def completion(gw: Gateway, body: CompletionRequest, request: Request):
    deadline = deadline_of(gw, request)
    _check_model(gw, body.model)
    async with _within(deadline):
        processed = await gw.off_loop(_process, gw, body.prompt)
    return await serve(gw, request, body, processed, "text", deadline)


async def serve(
    gw: Gateway,
    request: Request,
    body: SamplingFields,
    processed: ProcessedPrompt,
    kind: str,
    deadline: float,
):
    params = body.sampling_params(gw.settings.default_max_tokens, gw.vocab_size)
    try:
        check_fits(len(processed.token_ids), params.max_tokens, max_model_len=gw.max_model_len)
    except AdmissionError as exc:
        raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") from exc
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    request.state.completion_id = rid  # on the gateway's span, beside the client's X-Request-Id
    ids = [choice_id(rid, i) for i in range(params.n)]  # each choice runs as a request of its own
    streams = []  # subscribed before the task exists: nothing is missed
    try:
        for choice in ids:
            streams.append(await gw.bus.events.outputs(choice))
        spec = await route(gw, rid, processed, params, trace_of(request.scope.get("state", {})))
    except BaseException:
        for stream in streams:
            await stream.close()
        raise
    for choice in ids[1:]:  # each choice is traced as a request: the copies prefill nothing
        gw.record.create(
            choice,
            arrival=spec.arrival_time,
            prompt_tokens=len(processed.token_ids),
            max_tokens=params.max_tokens,
        )
    keepalive = gw.settings.sse_keepalive if body.stream else None
    collectors = [
        _collector(
            gw, request, choice, stream, params, deadline, spec.gateway, keepalive if len(ids) == 1 else None
        )
        for choice, stream in zip(ids, streams, strict=True)
    ]
    reply = Reply(gw, spec, kind, body, Choices(collectors, keepalive), ids)
    request.state.on_end = reply.end  # whatever becomes of the response, the request ends (door.py)
    if body.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream")
    return await reply.whole(request)


def _collector(
    gw: Gateway, request: Request, rid: str, stream, params: SamplingParams, deadline: float, owner: str,
    keepalive: float | None,
) -> OutputCollector:  # fmt: skip
    """The collector of one choice's outputs (`rid`: its request id), journaled and asked for again
    under that id."""
    return OutputCollector(
        stream, gw.processor.tokenizer, params.stop, deadline=deadline,
        arrival=getattr(request.state, "arrived", time.perf_counter()), keepalive=keepalive,
        on_tokens=lambda ids: gw.journal.add(rid, ids),
        ask=lambda index: gw.bus.events.resend(Resend(request_id=rid, index=index)),
        reconnects=lambda: gw.bus.reconnects, fenced=gw.reaper.fenced, owner=owner,
    )  # fmt: skip


class _within:
    """`asyncio.timeout` to the request's deadline (a perf_counter time), failing as a 504."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout_at(loop.time() + (deadline - time.perf_counter()))

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, *exc_info) -> None:
        try:
            await self._timeout.__aexit__(*exc_info)
        except TimeoutError:
            raise APIError(
                504, "the request's images and prompt were not ready in time", code="timeout"
            ) from None


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.model_name:
        raise APIError(
            404, f"model {clip(model)!r} does not exist; this server serves {gw.model_name!r}", param="model"
        )


def _process(gw: Gateway, prompt: str | list[int]) -> ProcessedPrompt:
    """A text-only prompt, on the gateway's processor thread."""
    if isinstance(prompt, list):
        return _token_prompt(gw, prompt)
    try:
        return gw.processor.process(prompt, [])
    except InputError as exc:
        raise APIError(400, str(exc)) from exc


def _token_prompt(gw: Gateway, ids: list[int]) -> ProcessedPrompt:
    """A `/v1/completions` prompt given as token ids goes to the engine as those ids: decoding and
    re-tokenising would change them (merges, special tokens, a second BOS), and benchmarks that
    send ids expect exactly that prompt length."""
    bad = next((t for t in ids if not 0 <= t < gw.vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"prompt token id {bad} is outside the vocabulary [0, {gw.vocab_size})", param="prompt"
        )
    if gw.processor.image_token_id in ids:
        raise APIError(
            400,
            f"prompt holds the image token id {gw.processor.image_token_id}, but /v1/completions takes "
            "no images; send images to /v1/chat/completions as image_url parts",
            param="prompt",
        )
    return ProcessedPrompt(list(ids), [], torch.empty(0, dtype=torch.long))
