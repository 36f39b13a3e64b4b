"""One accepted request's answer: an SSE stream or one JSON body in the OpenAI shapes, and the
request's end — recorded for the trace, its pixels released, and its work cancelled everywhere
unless it finished."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from common.errors import APIError
from common.protocol import RequestSpec
from services.gateway.api_models import SamplingFields
from services.gateway.collector import OutputCollector, Piece
from services.gateway.state import Gateway
from services.gateway.structured import ToolMode
from services.gateway.tool_calls import CallStream, parse

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the stream alive


class Reply:
    def __init__(
        self, gw: Gateway, spec: RequestSpec, kind: str, body: SamplingFields, collector: OutputCollector,
        tools: ToolMode = ToolMode.NONE,
    ) -> None:  # fmt: skip
        self.gw, self.spec, self.kind, self.body = gw, spec, kind, body
        self.tools = tools  # how the answer is read for tool calls (structured.py)
        self.rid = spec.request_id
        self.collector = collector
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first: float | None = None
        self.ended = False

    async def whole(self, request: Request) -> JSONResponse:
        text, outcome = [], "cancelled"
        try:
            async for piece in self._watched(request):
                text.append(piece.text)
            outcome = "ok"
        except APIError:
            outcome = "error"
            raise
        finally:
            await self._end(outcome)
        return JSONResponse(self._body("".join(text)))

    async def sse(self) -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            if self.kind == "chat":
                yield self._chunk({"role": "assistant", "content": ""}, None)
            calls = CallStream() if self.tools != ToolMode.NONE else None
            async for piece in self.collector.pieces():
                if piece.keepalive:
                    yield KEEPALIVE
                    continue
                self._mark_first()
                if calls is not None:
                    for chunk in self._call_chunks(calls.feed(piece.text), bool(piece.token_ids)):
                        yield chunk
                # A token whose text is held back (part of a UTF-8 character or of a stop string)
                # still gets its chunk, as vLLM sends it: clients time TTFT and ITL per chunk.
                elif piece.text or piece.token_ids:
                    yield self._chunk(piece.text, None)
            if calls is not None:
                for chunk in self._call_chunks(calls.flush(), False):
                    yield chunk
            yield self._chunk(None, self._finish_reason(calls is not None and calls.calls > 0))
            if self.body.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
            outcome = "ok"
        except APIError as exc:
            outcome = "error"
            yield _sse(exc.body())
            yield "data: [DONE]\n\n"
        finally:
            await self._end(outcome)

    def _call_chunks(self, deltas: list[dict], token: bool) -> list[str]:
        """The chunks of a tool-reading answer's deltas; a token that made none still gets one."""
        if not deltas and token:
            return [self._chunk("", None)]
        return [self._chunk(delta, None) for delta in deltas]

    def _finish_reason(self, called: bool) -> str:
        """As OpenAI says it: `tool_calls` when the model called tools of its own choice (auto,
        required); a named tool_choice's call ends with the plain reason."""
        reason = self.collector.outcome.finish_reason
        if called and reason == "stop" and self.tools != ToolMode.NAMED:
            return "tool_calls"
        return reason

    async def _watched(self, request: Request) -> AsyncIterator[Piece]:
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
            if not piece.keepalive:
                self._mark_first()
                yield piece

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
            prompt, completion, cached = o.prompt_tokens, o.completion_tokens, o.cached_tokens
        else:
            prompt, completion, cached = len(self.spec.prompt_token_ids), self.collector.received, 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _body(self, text: str) -> dict:
        reason = self.collector.outcome.finish_reason
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.tools != ToolMode.NONE:
                message["content"], calls = parse(text)
                if calls:
                    message["tool_calls"] = calls
                reason = self._finish_reason(bool(calls))
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self._envelope(), "choices": [choice], "usage": self._usage()}

    def _mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.gw.metrics.ttft.observe(self.collector.clock.ttft or 0.0)

    async def end(self) -> None:
        """The response is over (door.py calls this whatever became of it): a request that never
        ended here — its client left before its stream began — ends now, as cancelled."""
        await self._end("cancelled")

    async def _end(self, outcome: str) -> None:
        """Runs once. A request that did not finish ("error": it failed or ran out of time;
        "cancelled": its client left) is cancelled everywhere, freeing what it holds; one that
        did has its outcome recorded for the trace. Its pixels are no longer served either way."""
        if self.ended:
            return
        self.ended = True
        gw = self.gw
        gw.journal.end(self.rid)
        for img in self.spec.images:
            if img.pixels is not None and hasattr(img.pixels, "handle"):
                gw.transfer.release(img.pixels.handle)
        await self.collector.stream.close()
        clock = self.collector.clock
        if self.collector.complete and clock.ttft is not None:
            gw.record.outcome(self.rid, clock.ttft, clock.tbt_p90, clock.slo_met(gw.slo))
        gw.metrics.requests.labels(self.kind, outcome).inc()
        gw.metrics.latency.observe(time.perf_counter() - self.start)
        for gap in clock.gaps:
            gw.metrics.tbt.observe(gap)
        if outcome != "ok":
            reason = "client went away" if outcome == "cancelled" else "the request failed"
            with contextlib.suppress(Exception):
                await gw.cancel(self.rid, reason)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
