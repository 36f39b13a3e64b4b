"""Gathering one request's outputs: deltas arrive from prefill (first token) and decode (the rest)
over different connections, so they are put back in order by index and turned into text here,
with the same stop strings the engine applied, so text is right across the P→D hand-off.

The collector also times the tokens as they reach the gateway (not as the client reads them), for
the request's TTFT and time between tokens (TBT) in the trace."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from dataclasses import dataclass, field

from common.bus import EventStream
from common.engine.detokenizer import IncrementalDetokenizer
from common.errors import APIError
from common.protocol import ErrorOutput, FinalOutput, Message, TokenDelta, TokenLogprob
from common.stats import SLO, request_tbt, slo_met

log = logging.getLogger(__name__)
PROBE = 0.25  # seconds between looks at whether outputs should be asked for again
DROPPED = (
    "this gateway did not answer its peers for too long and was taken for dead, so the request was "
    "dropped; it serves again under a new name: retry the request"
)
GAP_WAIT = 0.5  # seconds a hole may stay open before the missing outputs are asked for again
SILENCE_FIRST, SILENCE_MAX = 2.0, 30.0  # ask again after this much silence, doubling up to the max
ERROR_STATUS = {"invalid_request_error": 400, "service_unavailable": 503, "timeout_error": 504}


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)
    keepalive: bool = False  # no output: the request is still waiting
    # One per token when the request asked for log-probabilities (None: an instance that did not
    # know them said the token again; it never happens on the paths a token normally takes).
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


@dataclass
class Outcome:
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, found in a prefix cache


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
    """One request's outputs, in order, as text pieces.

    `deadline` (perf_counter seconds) bounds the whole request; with `keepalive`, a silence that
    long yields a keep-alive piece (no text). Outputs come over core NATS, which drops what is in
    flight when the broker restarts or this gateway's connection is away. The one recovery rule
    (docs/architecture.md, "Lost outputs"): `ask(index)` broadcasts a Resend, and the instance that
    has the request (or ended it lately) says its outputs again from `index`, on the same
    subscription. The collector asks when it holds tokens after a hole (or a final count it has not
    reached) for GAP_WAIT, when its connection came back (`reconnects` moved), and after a silence,
    at growing intervals, since a lost final leaves nothing to notice.
    """

    def __init__(
        self,
        stream: EventStream,
        tokenizer,
        stop: tuple[str, ...],
        *,
        deadline: float,
        arrival: float,
        keepalive: float | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        ask: Callable[[int], Awaitable[None]] | None = None,
        reconnects: Callable[[], int] | None = None,
        fenced: Container[str] = (),
        owner: str | None = None,
    ) -> None:
        self.stream = stream
        self.on_tokens = on_tokens  # told each run of tokens as it is released, in order
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self.deadline = deadline
        self.keepalive = keepalive
        self.ask = ask
        self.reconnects = reconnects
        self.fenced = fenced  # instances taken for dead: what they still send is ignored
        self.owner = owner  # the gateway that routed the request: fenced, it was dropped everywhere
        self.outcome = Outcome()
        self.clock = TokenClock(arrival)
        self.received = 0  # output tokens released so far, for usage reported while streaming
        self.complete = False  # every output arrived, up to the final one
        self.asks = 0  # Resends sent
        self._tokens: dict[int, int] = {}  # index -> token, arrived but not yet released
        self._logprobs: dict[int, TokenLogprob | None] = {}  # index -> its logprobs, likewise
        self._expected: int | None = None  # how many outputs there are, once the final said
        now = time.perf_counter()
        self._progress = now  # when a token was last released (or the collector began)
        self._stuck_since: float | None = None  # when a hole in the outputs appeared
        self._silence = SILENCE_FIRST
        self._seen_reconnects = reconnects() if reconnects is not None else 0

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces in order; ends after the final output (raises APIError on an error output or
        past the deadline)."""
        quiet_since = time.perf_counter()
        while not self._done:
            now = time.perf_counter()
            if now >= self.deadline:
                late = f"the request did not finish in its {self._budget():g}s; it was cancelled"
                raise APIError(504, late, code="timeout")
            if self.owner is not None and self.owner in self.fenced:
                raise APIError(503, DROPPED, code="gateway_fenced", retry_after=1)
            if self._ask_due(now):
                await self._ask_again()
                continue
            wait = min(self.deadline - now, PROBE)
            if self.keepalive is not None:
                wait = min(wait, max(0.0, quiet_since + self.keepalive - now))
            try:
                msg = await self.stream.get(timeout=wait)
            except TimeoutError:
                if self.keepalive is not None and time.perf_counter() >= quiet_since + self.keepalive:
                    quiet_since = time.perf_counter()
                    yield Piece("", keepalive=True)
                continue
            piece = self.take(msg)
            if piece is not None:
                quiet_since = time.perf_counter()
                yield piece
        self.complete = True
        tail = self.detok.flush()
        if tail:
            yield Piece(tail)

    @property
    def _done(self) -> bool:
        return self._expected is not None and self.received >= self._expected

    def _ask_due(self, now: float) -> bool:
        if self.ask is None:
            return False
        if self.reconnects is not None and self.reconnects() != self._seen_reconnects:
            return True
        if self._stuck_since is not None:
            return now - self._stuck_since >= GAP_WAIT
        return now - self._progress >= self._silence

    async def _ask_again(self) -> None:
        """Ask whoever has the request to say its outputs again from the first one not released;
        they arrive on the subscription like any other. Re-arms every trigger, so an ask that met
        no listener (the holder's connection was not back yet) is made again."""
        self.asks += 1
        if self.reconnects is not None:
            self._seen_reconnects = self.reconnects()
        self._silence = min(2 * self._silence, SILENCE_MAX)
        self._progress = time.perf_counter()
        if self._stuck_since is not None:
            self._stuck_since = self._progress
        try:
            await self.ask(self.received)
        except Exception as exc:  # NATS still away: ask again at the next due time
            log.warning("outputs could not be asked for again (%r)", exc)

    def take(self, msg: Message) -> Piece | None:
        """Fold one output in: tokens are kept by index (a repeat or an overlap is harmless) and
        released as soon as they follow on from what was released; returns what that released."""
        if msg.source in self.fenced:
            return None  # it came back after it was taken for dead; the request went on elsewhere
        if isinstance(msg, ErrorOutput):
            raise APIError(ERROR_STATUS.get(msg.code, 500), msg.message, code=msg.code)
        if isinstance(msg, FinalOutput):
            self._expected = msg.num_outputs
            usage = msg.usage
            self.outcome = Outcome(
                msg.finish_reason, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
            )
        elif isinstance(msg, TokenDelta):
            for k, token in enumerate(msg.token_ids):
                at = msg.index + k
                if at >= self.received and (at not in self._tokens or self._logprobs.get(at) is None):
                    self._tokens[at] = token  # a copy with logprobs wins over one without
                    self._logprobs[at] = msg.logprobs[k] if msg.logprobs else None
        ids, logprobs = [], []
        while self.received in self._tokens:
            ids.append(self._tokens.pop(self.received))
            logprobs.append(self._logprobs.pop(self.received, None))
            self.received += 1
        stuck = bool(self._tokens) or (self._expected is not None and self.received < self._expected)
        if not stuck:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = time.perf_counter()
        if not ids:
            return None
        self._progress = time.perf_counter()
        self._silence = SILENCE_FIRST
        self.clock.add(len(ids), self._progress)
        if self.on_tokens is not None:
            self.on_tokens(ids)
        return Piece(self.detok.add(ids), ids, logprobs=logprobs)

    def _budget(self) -> float:
        return round(self.deadline - self.clock.arrival, 1)
