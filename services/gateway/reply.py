"""One accepted request's answer: an SSE stream or one JSON body in the OpenAI shapes, and the
request's end — recorded for the trace, its pixels released, and its work cancelled everywhere
unless it finished. A request of n choices answers each under its `index` (choices.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from common.errors import APIError
from common.protocol import RequestSpec, TokenLogprob
from services.gateway.api_models import SamplingFields
from services.gateway.choices import ChoicePiece, Choices
from services.gateway.logprobs import TokenText, chat_content, completion_logprobs
from services.gateway.state import Gateway

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the stream alive


class Reply:
    def __init__(
        self, gw: Gateway, spec: RequestSpec, kind: str, body: SamplingFields, choices: Choices,
        ids: list[str],
    ) -> None:  # fmt: skip
        self.gw, self.spec, self.kind, self.body = gw, spec, kind, body
        self.rid = spec.request_id
        self.choices = choices
        self.ids = ids  # each choice's request id (choice_id), in choice order
        self.text_of: TokenText | None = gw.token_text if spec.sampling.logprobs is not None else None
        self.offsets = [0] * len(choices)  # completions: where each choice's next token's text starts
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first: float | None = None
        self.ended = False

    async def whole(self, request: Request) -> JSONResponse:
        n = len(self.choices)
        texts: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob | None]] = [[] for _ in range(n)]
        outcome = "cancelled"
        try:
            async for got in self._watched(request):
                if got.piece is not None:
                    texts[got.index].append(got.piece.text)
                    ids[got.index] += got.piece.token_ids
                    logprobs[got.index] += got.piece.logprobs
            outcome = "ok"
        except APIError:
            outcome = "error"
            raise
        finally:
            await self._end(outcome)
        choices = [self._choice(i, "".join(texts[i]), ids[i], logprobs[i]) for i in range(n)]
        return JSONResponse({**self._envelope(), "choices": choices, "usage": self._usage()})

    async def sse(self) -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            if self.kind == "chat":
                for i in range(len(self.choices)):
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None)
            async for got in self.choices.pieces():
                piece = got.piece
                if piece is None:  # the choice ended
                    reason = self.choices.collectors[got.index].outcome.finish_reason
                    yield self._chunk(got.index, None, reason)
                    continue
                if piece.keepalive:
                    yield KEEPALIVE
                    continue
                self._mark_first()
                # A token whose text is held back (part of a UTF-8 character or of a stop string)
                # still gets its chunk, as vLLM sends it: clients time TTFT and ITL per chunk.
                if piece.text or piece.token_ids:
                    lps = self._logprobs(got.index, piece.token_ids, piece.logprobs)
                    yield self._chunk(got.index, piece.text, None, lps)
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

    async def _watched(self, request: Request) -> AsyncIterator[ChoicePiece]:
        """The pieces, cancelling the request if the (non-streaming) client goes away meanwhile."""
        pieces = self.choices.pieces()
        while True:
            nxt = asyncio.ensure_future(anext(pieces, None))
            while not nxt.done():
                await asyncio.wait({nxt}, timeout=0.5)
                if not nxt.done() and await request.is_disconnected():
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    raise asyncio.CancelledError
            got = nxt.result()
            if got is None:
                return
            if got.piece is None or not got.piece.keepalive:
                if got.piece is not None:
                    self._mark_first()
                yield got

    def _logprobs(self, index: int, ids: list[int], logprobs: list[TokenLogprob | None]) -> dict | None:
        """A piece's tokens' log-probabilities in the kind's shape; None unless the request asked."""
        if self.text_of is None:
            return None
        if self.kind == "chat":
            return {"content": chat_content(self.text_of, ids, logprobs)}
        found = completion_logprobs(self.text_of, ids, logprobs, self.offsets[index])
        self.offsets[index] += sum(len(t) for t in found["tokens"])
        return found

    def _chunk(self, index: int, delta, finish_reason, logprobs: dict | None = None) -> str:
        if self.kind == "chat":
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta is not None else {})
            choice = {"index": index, "delta": content, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {
                "index": index,
                "text": delta or "",
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
        chunk = {**self._envelope(), "choices": [choice]}
        if self.body.stream_options and self.body.stream_options.continuous_usage_stats:
            chunk["usage"] = self._usage()
        return _sse(chunk)

    def _choice(self, index: int, text: str, ids: list[int], logprobs: list[TokenLogprob | None]) -> dict:
        reason = self.choices.collectors[index].outcome.finish_reason
        lps = self._logprobs(index, ids, logprobs)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "finish_reason": reason, "logprobs": lps}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": lps}

    def _envelope(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if not self.body.stream:
            obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.gw.model_name}

    def _usage(self) -> dict:
        """The final usage once the request is done — the prompt once, the completion tokens of
        every choice, as OpenAI counts them; while streaming (`continuous_usage_stats`) the prompt
        as the gateway tokenised it and the output tokens received so far."""
        if self.choices.complete:
            first = self.choices.first.outcome
            prompt, cached = first.prompt_tokens, first.cached_tokens
            completion = sum(c.outcome.completion_tokens for c in self.choices.collectors)
        else:
            prompt, completion, cached = len(self.spec.prompt_token_ids), self.choices.received, 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.gw.metrics.ttft.observe(self.choices.first.clock.ttft or 0.0)

    async def end(self) -> None:
        """The response is over (door.py calls this whatever became of it): a request that never
        ended here — its client left before its stream began — ends now, as cancelled."""
        await self._end("cancelled")

    async def _end(self, outcome: str) -> None:
        """Runs once. A request that did not finish ("error": it failed or ran out of time;
        "cancelled": its client left) is cancelled everywhere, every choice of it, freeing what it
        holds; one that did has its outcome recorded for the trace. Its pixels are no longer served
        either way."""
        if self.ended:
            return
        self.ended = True
        gw = self.gw
        for rid in self.ids:
            gw.journal.end(rid)
        for img in self.spec.images:
            if img.pixels is not None and hasattr(img.pixels, "handle"):
                gw.transfer.release(img.pixels.handle)
        for collector in self.choices.collectors:
            await collector.stream.close()
        for rid, collector in zip(self.ids, self.choices.collectors, strict=True):
            clock = collector.clock
            if collector.complete and clock.ttft is not None:
                gw.record.outcome(rid, clock.ttft, clock.tbt_p90, clock.slo_met(gw.slo))
            for gap in clock.gaps:
                gw.metrics.tbt.observe(gap)
        gw.metrics.requests.labels(self.kind, outcome).inc()
        gw.metrics.latency.observe(time.perf_counter() - self.start)
        if outcome != "ok":
            reason = "client went away" if outcome == "cancelled" else "the request failed"
            for rid in self.ids:
                with contextlib.suppress(Exception):
                    await gw.cancel(rid, reason)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
