"""Paged KV block allocation: which physical blocks each request owns."""

from __future__ import annotations

from collections import deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks. Allocation returns None when short, never a sentinel.

    Blocks are handed out lowest id first and freed blocks go to the back of the queue, so the
    order is deterministic and tests can assert exact ids.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        """Whether `request_id` could grow to hold `num_tokens` tokens with the blocks free now."""
        return self._extra_blocks(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens; None (and no change) if short."""
        extra = self._extra_blocks(request_id, num_tokens)
        if extra > len(self._free):
            return None
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(extra))
        return table

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks; returns how many were freed (0 if it held none)."""
        table = self._tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)

    def owners(self) -> set[str]:
        """The requests holding blocks."""
        return set(self._tables)

    def check_integrity(self) -> None:
        """Every block is either free or owned by exactly one request, and nothing else."""
        used = [b for t in self._tables.values() for b in t]
        free = list(self._free)
        assert len(set(used)) == len(used), "a block is owned twice"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(used) & set(free), "a block is both free and owned"
        assert len(used) + len(free) == self.num_blocks, (
            f"free {len(free)} + used {len(used)} != total {self.num_blocks}"
        )

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)
