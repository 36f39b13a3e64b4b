"""The free KV blocks as runs of consecutive ids, so a request's blocks can be kept side by side.

A run is [start, end). Runs are maximal (two never touch: giving back the block between them
joins them) and each is found by its first and by its end, so taking from a run's front, taking
from inside it and giving a block back are O(1); the longest run comes off a heap in O(log n),
its stale entries (runs since cut or joined) dropped as they surface.
"""

from __future__ import annotations

import heapq


class FreeRuns:
    def __init__(self, num_blocks: int) -> None:
        self._end: dict[int, int] = {}  # start -> end
        self._start: dict[int, int] = {}  # end -> start
        self._heap: list[tuple[int, int]] = []  # (-length, start), some stale
        self._count = 0
        if num_blocks:
            self._add(0, num_blocks)
            self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def runs(self) -> list[tuple[int, int]]:
        """Every run, lowest first."""
        return sorted(self._end.items())

    def end_of_run_at(self, start: int) -> int | None:
        """The end of the run beginning exactly at `start`; None if no run begins there."""
        return self._end.get(start)

    def longest(self) -> tuple[int, int] | None:
        """The longest run (the lowest of equals), or None when nothing is free."""
        while self._heap:
            length, start = self._heap[0]
            if self._end.get(start) == start - length:
                return start, start - length
            heapq.heappop(self._heap)
        return None

    def take(self, start: int, at: int, count: int) -> range:
        """Blocks [at, at + count) out of the run beginning at `start`, which must hold them."""
        end = self._end[start]
        assert start <= at and count > 0 and at + count <= end, (
            f"[{at}, {at + count}) is not in [{start}, {end})"
        )
        self._remove(start, end)
        if at > start:
            self._add(start, at)
        if at + count < end:
            self._add(at + count, end)
        self._count -= count
        return range(at, at + count)

    def give(self, block: int) -> None:
        """Make `block` (not free) free, joining the runs on either side of it."""
        start, end = block, block + 1
        if (left := self._start.get(block)) is not None:
            self._remove(left, block)
            start = left
        if (right := self._end.get(block + 1)) is not None:
            self._remove(block + 1, right)
            end = right
        self._add(start, end)
        self._count += 1

    def check(self) -> set[int]:
        """Assert the runs are consistent, maximal and counted; returns the free blocks."""
        assert {e: s for s, e in self._end.items()} == self._start, "the run maps disagree"
        blocks: set[int] = set()
        previous_end = None
        for start, end in self.runs():
            assert start < end, f"an empty run at {start}"
            assert previous_end is None or previous_end < start, f"runs overlap or touch at {start}"
            blocks.update(range(start, end))
            previous_end = end
        assert len(blocks) == self._count, f"{self._count} counted free, {len(blocks)} in runs"
        return blocks

    def _add(self, start: int, end: int) -> None:
        self._end[start] = end
        self._start[end] = start
        heapq.heappush(self._heap, (start - end, start))
        if len(self._heap) > 2 * len(self._end) + 64:  # mostly stale: rebuild
            self._heap = [(s - e, s) for s, e in self._end.items()]
            heapq.heapify(self._heap)

    def _remove(self, start: int, end: int) -> None:
        del self._end[start]
        del self._start[end]
