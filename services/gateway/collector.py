"""Gathering one request's outputs: deltas arrive from prefill (first token) and decode (the rest)
over different connections, so they are put back in order by index and turned into text here,
with the same stop strings the engine applied, so text is right across the P→D hand-off."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.bus import EventStream
from common.engine.detokenizer import IncrementalDetokenizer
from common.protocol import ErrorOutput, FinalOutput, TokenDelta
from services.gateway.errors import APIError

ERROR_STATUS = {"invalid_request_error": 400, "service_unavailable": 503, "timeout_error": 504}


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class OutputCollector:
    def __init__(self, stream: EventStream, tokenizer, stop: tuple[str, ...], timeout: float) -> None:
        self.stream = stream
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self.timeout = timeout
        self.outcome = Outcome()
        self.started = False  # any output reached the client

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces in order; ends after the final output (raises APIError on an error output)."""
        pending: dict[int, tuple[int, ...]] = {}
        next_index, expected = 0, None
        while expected is None or next_index < expected:
            try:
                msg = await self.stream.get(timeout=self.timeout)
            except TimeoutError as exc:
                raise APIError(504, f"no output for {self.timeout:g}s; the request was cancelled") from exc
            if isinstance(msg, ErrorOutput):
                raise APIError(ERROR_STATUS.get(msg.code, 500), msg.message, code=msg.code)
            if isinstance(msg, FinalOutput):
                expected = msg.num_outputs
                self.outcome = Outcome(
                    msg.finish_reason, msg.usage.prompt_tokens, msg.usage.completion_tokens
                )
                continue
            if isinstance(msg, TokenDelta) and msg.index >= next_index:  # older: a re-prefill's repeat
                pending[msg.index] = msg.token_ids
            while next_index in pending:
                ids = list(pending.pop(next_index))
                next_index += len(ids)
                self.started = True
                yield Piece(self.detok.add(ids), ids)
        tail = self.detok.flush()
        if tail:
            yield Piece(tail)
