"""A request's choices as one stream: with `n` > 1 each choice is a request of its own from its fork
on (common/engine/forks.py), with its own outputs subject and its own collector; their pieces are
merged here in the order they arrive, each tagged with its choice's index."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.gateway.collector import OutputCollector, Piece


@dataclass
class ChoicePiece:
    index: int
    piece: Piece | None  # None: the choice has ended (all its outputs are in)


class Choices:
    """The collectors of a request's choices, in choice order; `keepalive` (seconds) is the merged
    stream's: a silence of all of them that long yields a keep-alive piece."""

    def __init__(self, collectors: list[OutputCollector], keepalive: float | None = None) -> None:
        self.collectors = collectors
        self.keepalive = keepalive

    def __len__(self) -> int:
        return len(self.collectors)

    @property
    def first(self) -> OutputCollector:
        return self.collectors[0]

    @property
    def complete(self) -> bool:
        return all(c.complete for c in self.collectors)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.collectors)

    async def pieces(self) -> AsyncIterator[ChoicePiece]:
        """Every choice's pieces as they come, then its end; raises the first error any choice meets
        (an error output, the deadline), after which nothing more is read."""
        if len(self.collectors) == 1:  # one choice: its own collector keeps the stream alive
            async for piece in self.first.pieces():
                yield ChoicePiece(0, piece)
            yield ChoicePiece(0, None)
            return
        queue: asyncio.Queue[ChoicePiece | BaseException] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, c, queue)) for i, c in enumerate(self.collectors)]
        try:
            open_choices = len(pumps)
            while open_choices:
                try:
                    async with asyncio.timeout(self.keepalive):
                        got = await queue.get()
                except TimeoutError:
                    yield ChoicePiece(0, Piece("", keepalive=True))
                    continue
                if isinstance(got, BaseException):
                    raise got
                open_choices -= got.piece is None
                yield got
        finally:
            for pump in pumps:
                pump.cancel()
            for pump in pumps:
                with contextlib.suppress(BaseException):
                    await pump

    @staticmethod
    async def _pump(index: int, collector: OutputCollector, queue: asyncio.Queue) -> None:
        try:
            async for piece in collector.pieces():
                queue.put_nowait(ChoicePiece(index, piece))
            queue.put_nowait(ChoicePiece(index, None))
        except Exception as exc:  # the merged stream raises it
            queue.put_nowait(exc)
