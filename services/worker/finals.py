"""The last outputs of the requests that ended here, kept for a bounded window so that a gateway
that missed them (NATS restarted under it) can ask for them again (docs/architecture.md, "Lost
outputs"). Nothing else about an ended request stays in the worker.

Entries are kept in the order they ended, so the oldest is always first: a sweep pops from the
front until it meets one still inside the window. Every `keep` and `get` sweeps, and one timer
(loop.call_later, re-armed for the next oldest) sweeps when nothing else happens, so the window
holds in an idle worker too.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import ErrorOutput, FinalOutput, TokenLogprob

FINALS_WINDOW = 120.0  # seconds: outlasts a broker restart and the gateway's asks after it


@dataclass(frozen=True)
class Ended:
    tokens: tuple[int, ...]  # every output token of the request
    last: FinalOutput | ErrorOutput  # how it ended
    at: float  # when (the window's clock)
    logprobs: tuple[TokenLogprob | None, ...] = ()  # one per token when asked for (None: not known)


class Finals:
    def __init__(self, window: float = FINALS_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._ended)

    def keep(
        self, request_id: str, tokens: list[int], last: FinalOutput | ErrorOutput,
        logprobs: list[TokenLogprob | None] | tuple = (),
    ) -> None:  # fmt: skip
        """The request ended with `last` after `tokens` (and their `logprobs`): keep them for the window."""
        self._ended.pop(request_id, None)  # ended again (a retry): it goes to the back
        self._ended[request_id] = Ended(tuple(tokens), last, self.clock(), tuple(logprobs))
        self.sweep()

    def get(self, request_id: str) -> Ended | None:
        self.sweep()
        return self._ended.get(request_id)

    def sweep(self) -> None:
        """Drop what ended more than `window` ago, and arm the timer for the next oldest."""
        cutoff = self.clock() - self.window
        while self._ended and next(iter(self._ended.values())).at <= cutoff:
            self._ended.popitem(last=False)
        self._arm()

    def _arm(self) -> None:
        """One timer at a time, due when the oldest entry leaves the window. Entries join at the
        back, so the oldest can only leave earlier than that (a `keep` of the same request): the
        timer then fires early, sweeps nothing and arms again."""
        if self._timer is not None or not self._ended:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next keep or get sweeps
            return
        due = next(iter(self._ended.values())).at + self.window - self.clock()
        self._timer = loop.call_later(max(0.0, due) + 0.001, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.sweep()
