"""The journal of what each running request has streamed, kept in Redis for the resume path.

When the instance generating a request dies, the request resumes elsewhere from the tokens the
client has already been sent (design.md, "Reliability rules"): the decode task is redelivered,
its KV is gone with the dead instance's peer, and the request is prefilled again over its prompt
*and* these tokens. Only the gateway knows exactly which tokens reached the client, so it keeps
the journal. Writes are batched: one pipelined round trip per `interval` for every request that
streamed meanwhile, off the path that delivers tokens. A resume comes at least
TRIDENT_FAILOVER_AFTER (1.5 s) after the death, long after the last tokens were journaled.

A journal is dropped when its request ends at the gateway. One whose write failed is dropped
too and not written again: a journal with a gap would resume from a history the client never
saw, while no journal resumes from the first token (the old, still correct, regenerate path).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from common.aio import raise_if_cancelled

if TYPE_CHECKING:
    from common.store import Store

log = logging.getLogger(__name__)
JOURNAL_TTL = 600.0  # seconds a journal outlives its last write (a gateway that died mid-request)


class OutputJournal:
    def __init__(self, store: Store, interval: float = 0.02, ttl: float = JOURNAL_TTL) -> None:
        self.store = store
        self.interval = interval
        self.ttl = ttl
        self._streamed: dict[str, list[int]] = {}
        self._ended: set[str] = set()
        self._broken: set[str] = set()  # a write failed: never journaled again
        self._dirty = asyncio.Event()
        self.failures = 0

    def add(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens just released to the client, in order."""
        if request_id not in self._broken:
            self._streamed.setdefault(request_id, []).extend(token_ids)
            self._dirty.set()

    def end(self, request_id: str) -> None:
        """The request is over at the gateway: its journal is no longer needed."""
        self._streamed.pop(request_id, None)
        self._broken.discard(request_id)
        self._ended.add(request_id)
        self._dirty.set()

    async def run(self) -> None:
        while True:
            raise_if_cancelled()
            await self._dirty.wait()
            await asyncio.sleep(self.interval)  # gather what the next few deltas bring
            await self.write()

    async def write(self) -> None:
        """Write everything queued now (also what `close` calls last)."""
        self._dirty.clear()
        streamed, ended = self._streamed, self._ended
        self._streamed, self._ended = {}, set()
        if not streamed and not ended:
            return
        try:
            await self.store.requests.journal_outputs(streamed, ended, self.ttl)
        except Exception as exc:  # metadata: an outage must not fail requests, only their resume
            self.failures += 1
            self._broken |= streamed.keys()
            self._ended |= streamed.keys() | ended  # delete what may have been half written
            log.warning("output journal write failed for %d requests: %r", len(streamed), exc)
