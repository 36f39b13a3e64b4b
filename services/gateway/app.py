"""The OpenAI-compatible gateway: validation, images, the request processor, routing, streaming."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import generate_latest

from common.engine.admission import AdmissionError, check_fits
from common.engine.processor import InputError, ProcessedPrompt, load_image
from common.errors import APIError, api_error_handler, error_response, validation_error_handler
from common.protocol import Cancel
from common.roles import Role
from services.gateway.api_models import ChatCompletionRequest, CompletionRequest, SamplingFields
from services.gateway.collector import OutputCollector
from services.gateway.images import fetch_image
from services.gateway.routing import live_roles, route
from services.gateway.state import Gateway
from services.settings import GatewaySettings


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    gw = Gateway(settings or GatewaySettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await gw.start()
        yield
        await gw.close()

    app = FastAPI(title="Trident", lifespan=lifespan)
    app.state.gateway = gw
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        request.state.arrived = time.perf_counter()  # a request's TTFT counts from here
        if gw.api_keys and request.url.path.startswith("/v1/"):
            token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if token not in gw.api_keys:
                return error_response(APIError(401, "missing or invalid API key", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        missing = sorted(set(Role) - await live_roles(gw.store))
        body = {"ready": not missing, "missing_roles": missing}
        return JSONResponse(body, status_code=200 if not missing else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": gw.model_name, "object": "model", "created": 0, "owned_by": "trident"}
        return {"object": "list", "data": [card]}

    @app.get("/v1/cluster")
    async def cluster() -> dict:
        instances = [hb.model_dump() for hb in await gw.store.registry.instances()]
        plan = await gw.store.planning.current_plan()
        return {"instances": instances, "plan": plan.model_dump() if plan else None}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages, urls = body.template_messages()
        if len(urls) > gw.images.max_images:
            raise APIError(400, f"at most {gw.images.max_images} images per request", param="messages")
        blobs = await asyncio.gather(*(fetch_image(u, gw.images) for u in urls))
        try:
            pil = await gw.off_loop(lambda: [load_image(b) for b in blobs])
        except InputError as exc:
            raise APIError(400, str(exc), param="image_url") from exc
        prompt = gw.processor.chat_prompt(messages)
        return await serve(gw, request, body, prompt, pil, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve(gw, request, body, body.prompt, [], "text")

    return app


async def serve(gw: Gateway, request: Request, body: SamplingFields, prompt, images, kind: str):
    _check_model(gw, body.model)
    if gw.in_flight >= gw.settings.max_in_flight:
        raise APIError(429, "too many requests in flight; retry shortly", code="queue_full")
    processed = await gw.off_loop(_process, gw, prompt, images)
    params = body.sampling_params(gw.settings.default_max_tokens)
    try:
        check_fits(len(processed.token_ids), params.max_tokens, max_model_len=gw.max_model_len)
    except AdmissionError as exc:
        raise APIError(400, str(exc), param="max_tokens", code="context_length_exceeded") from exc
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    stream = await gw.bus.events.outputs(rid)  # subscribed before the task exists: nothing is missed
    try:
        await route(gw, rid, processed, params)
    except BaseException:
        await stream.close()
        raise
    collector = OutputCollector(
        stream, gw.processor.tokenizer, params.stop, gw.settings.request_timeout,
        arrival=getattr(request.state, "arrived", time.perf_counter()),
        on_tokens=lambda ids: gw.journal.add(rid, ids),
    )  # fmt: skip
    gw.begin_request()
    run = _Run(gw, rid, kind, body, collector, stream, prompt_tokens=len(processed.token_ids))
    if body.stream:
        return StreamingResponse(run.sse(), media_type="text/event-stream")
    return await run.whole(request)


def _check_model(gw: Gateway, model: str) -> None:
    if model != gw.model_name:
        raise APIError(
            404, f"model {model!r} does not exist; this server serves {gw.model_name!r}", param="model"
        )


def _process(gw: Gateway, prompt, images):
    if isinstance(prompt, list):
        return _token_prompt(gw, prompt)
    try:
        return gw.processor.process(prompt, images)
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


class _Run:
    """One accepted request's life at the gateway: its output, and its cancellation if abandoned."""

    def __init__(
        self, gw: Gateway, rid: str, kind: str, body: SamplingFields, collector, stream, prompt_tokens: int
    ) -> None:
        self.gw, self.rid, self.kind, self.body = gw, rid, kind, body
        self.prompt_tokens = prompt_tokens
        self.collector, self.stream = collector, stream
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first: float | None = None

    async def whole(self, request: Request) -> JSONResponse:
        text, done = [], False
        try:
            async for piece in self._watched(request):
                text.append(piece.text)
            done = True
        finally:
            await self._end(done)
        return JSONResponse(self._body("".join(text)))

    async def _watched(self, request: Request):
        """The pieces, cancelling the request if the (non-streaming) client goes away meanwhile."""
        pieces = self.collector.pieces()
        while True:
            nxt = asyncio.ensure_future(anext(pieces, None))
            while not nxt.done():
                await asyncio.wait({nxt}, timeout=0.5)
                if not nxt.done() and await request.is_disconnected():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    raise asyncio.CancelledError
            piece = nxt.result()
            if piece is None:
                return
            self._mark_first()
            yield piece

    async def sse(self):
        done = False
        try:
            if self.kind == "chat":
                yield self._chunk({"role": "assistant", "content": ""}, None)
            async for piece in self.collector.pieces():
                self._mark_first()
                # A token whose text is held back (part of a UTF-8 character or of a stop string)
                # still gets its chunk, as vLLM sends it: clients time TTFT and ITL per chunk.
                if piece.text or piece.token_ids:
                    yield self._chunk(piece.text, None)
            yield self._chunk(None, self.collector.outcome.finish_reason)
            if self.body.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
            done = True
        except APIError as exc:
            yield _sse(exc.body())
            yield "data: [DONE]\n\n"
            done = True
        finally:
            await self._end(done)

    def _chunk(self, delta, finish_reason) -> str:
        if self.kind == "chat":
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta is not None else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": None}
        chunk = {**self._envelope(), "choices": [choice]}
        if self.body.stream_options and self.body.stream_options.continuous_usage_stats:
            chunk["usage"] = self._usage()
        return _sse(chunk)

    def _envelope(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if not self.body.stream:
            obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.gw.model_name}

    def _usage(self) -> dict:
        """The final usage once the request is done; while streaming (`continuous_usage_stats`)
        the prompt as the gateway tokenised it and the output tokens received so far."""
        o = self.collector.outcome
        if self.collector.complete:
            prompt, completion = o.prompt_tokens, o.completion_tokens
        else:
            prompt, completion = self.prompt_tokens, self.collector.received
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _body(self, text: str) -> dict:
        reason = self.collector.outcome.finish_reason
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self._envelope(), "choices": [choice], "usage": self._usage()}

    def _mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.gw.metrics.ttft.observe(self.collector.clock.ttft or 0.0)

    async def _end(self, done: bool) -> None:
        """Always runs: a request that did not finish is cancelled everywhere, freeing its memory;
        one that did has its outcome recorded for the trace."""
        self.gw.end_request()
        self.gw.journal.end(self.rid)
        await self.stream.close()
        clock = self.collector.clock
        if self.collector.complete and clock.ttft is not None:
            self.gw.record.outcome(self.rid, clock.ttft, clock.tbt_p90, clock.slo_met(self.gw.slo))
        status = "ok" if done else "cancelled"
        self.gw.metrics.requests.labels(self.kind, status).inc()
        self.gw.metrics.latency.observe(time.perf_counter() - self.start)
        if not done:
            with contextlib.suppress(Exception):
                await self.gw.bus.events.cancel(Cancel(request_id=self.rid, reason="client went away"))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
