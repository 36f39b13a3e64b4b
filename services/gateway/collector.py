"""Gathering one request's outputs: deltas arrive from prefill (first token) and decode (the rest)
over different connections, so they are put back in order by index and turned into text here,
with the same stop strings the engine applied, so text is right across the P→D hand-off.

The collector also times the tokens as they reach the gateway (not as the client reads them), for
the request's TTFT and time between tokens (TBT) in the trace."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from common.bus import EventStream
from common.engine.detokenizer import IncrementalDetokenizer
from common.errors import APIError
from common.protocol import ErrorOutput, FinalOutput, TokenDelta
from common.stats import SLO, request_tbt, slo_met

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


@dataclass
class TokenClock:
    """When a request's output tokens reached the gateway (perf_counter seconds).

    A delta may carry several tokens; it counts as that many tokens, the gap since the previous
    token split evenly among them. Tokens that come with the first one have no gap before them
    (0 s): the first token's wait is the TTFT, not a TBT.
    """

    arrival: float  # the HTTP request reached the gateway
    first: float | None = None
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def add(self, count: int, at: float) -> None:
        if self.first is None:
            self.first = self.last = at
            self.gaps += [0.0] * (count - 1)
            return
        self.gaps += [(at - self.last) / count] * count
        self.last = at

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tbt_p90(self) -> float | None:
        """None with at most one output token: there is no gap to measure."""
        return request_tbt(self.gaps)

    def slo_met(self, slo: SLO) -> bool:
        return slo_met(self.ttft, self.tbt_p90, slo)


class OutputCollector:
    def __init__(
        self, stream: EventStream, tokenizer, stop: tuple[str, ...], timeout: float, arrival: float,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:  # fmt: skip
        self.stream = stream
        self.on_tokens = on_tokens  # told each run of tokens as it is released, in order
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self.timeout = timeout
        self.outcome = Outcome()
        self.clock = TokenClock(arrival)
        self.received = 0  # output tokens so far, for usage reported while streaming
        self.started = False  # any output reached the client
        self.complete = False  # every output arrived, up to the final one

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces in order; ends after the final output (raises APIError on an error output)."""
        pending: dict[int, tuple[int, ...]] = {}
        next_index, expected = 0, None
        while expected is None or next_index < expected:
            try:
                msg = await self.stream.get(timeout=self.timeout)
            except TimeoutError as exc:
                raise APIError(504, f"no output for {self.timeout:g}s; the request was cancelled") from exc
            now = time.perf_counter()
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
                self.received = next_index
                self.clock.add(len(ids), now)
                if self.on_tokens is not None:
                    self.on_tokens(ids)
                self.started = True
                yield Piece(self.detok.add(ids), ids)
        self.complete = True
        tail = self.detok.flush()
        if tail:
            yield Piece(tail)
