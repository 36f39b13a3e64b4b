"""Paged KV block allocation: which physical blocks each request owns, and which full blocks are kept
for reuse by the hash of everything their KV depends on (prefix caching).

A block is in exactly one of three states:

- owned: in one or more requests' tables (its reference count), shared when a prefix is;
- cached: owned by nobody, but holding a full block's KV under its hash, kept until an allocation
  needs the space, least recently used first;
- free: holding nothing anyone can find.

So cached blocks never delay admission: `num_free` counts them, and `allocate` takes a cached block
(forgetting its hash) only when no free one is left.

Where a request's blocks lie matters on a CPU: a decode whose context is one run of consecutive
blocks is attended to where it lies in the cache, and any other is first gathered into a copy
(`attention.py`). So a request grows into the blocks right after its last one while they are free,
and a request starting afresh is placed where there is most room: in the longest free run, and in
the middle of it when the blocks just before belong to a request that may grow into them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.engine.free_runs import FreeRuns


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks. Allocation returns None when short, never a sentinel.

    Placement is deterministic (tests assert exact ids). With `caching` off no block is ever cached:
    a freed block is free at once.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free = FreeRuns(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> the hash it is found by
        self._by_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # owned by nobody, oldest use first
        # Counters since start (metrics): tokens looked up, tokens found, cached blocks given up.
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        # Once watched (`watch_changes`): each hash made findable (True) or given up (False) since
        # the changes were last taken, for a worker to tell the cluster where prefixes live.
        self._changes: dict[bytes, bool] | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody owns."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks found by hash (owned or not)."""
        return len(self._by_hash)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        """Whether `request_id` could grow to hold `num_tokens` tokens with the blocks free now."""
        return self._extra_blocks(request_id, num_tokens) <= self.num_free

    # -- prefix caching ---------------------------------------------------------------------------
    def longest_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest run of `hashes` from the first (none with caching off)."""
        found: list[int] = []
        if self.caching:
            for h in hashes:
                block = self._by_hash.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def attach(self, request_id: str, blocks: Sequence[int]) -> None:
        """Start a request's table with cached `blocks` (its prefix), sharing them."""
        assert not self._tables.get(request_id), "a prefix is attached to a request holding no blocks"
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        if blocks:
            self._tables[request_id] = list(blocks)

    def count_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """A request admitted after looking up `queried_tokens` of its tokens and finding `hit_tokens`."""
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def remember(self, request_id: str, hashes: Sequence[bytes], start: int = 0) -> None:
        """Make the request's blocks [start, len(hashes)) (full, computed) findable by those hashes.
        A block whose hash another block already has stays unfindable: the first copy is kept."""
        if not self.caching:
            return
        table = self._tables.get(request_id, [])
        for block, h in zip(table[start:], hashes[start:], strict=False):
            if block not in self._hash_of and h not in self._by_hash:
                self._hash_of[block] = h
                self._by_hash[h] = block
                if self._changes is not None:
                    self._changes[h] = True

    def watch_changes(self) -> None:
        """Start keeping the hashes gained and given up, for `take_changes`."""
        self._changes = {}

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The hashes made findable and those given up since the last call (each in one list, by
        its state now); ([], []) unless watched."""
        changes, self._changes = self._changes, ({} if self._changes is not None else None)
        if not changes:
            return [], []
        return [h for h, found in changes.items() if found], [h for h, found in changes.items() if not found]

    def cached_hashes(self) -> list[bytes]:
        """Every hash a block is findable by now."""
        return list(self._by_hash)

    # -- owning -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens; None (and no change) if short."""
        extra = self._extra_blocks(request_id, num_tokens)
        if extra > self.num_free:
            return None
        table = self._tables.setdefault(request_id, [])
        while extra:
            taken = self._take(table[-1] + 1 if table else None, extra)
            for block in taken:
                self._refs[block] = 1
            table.extend(taken)
            extra -= len(taken)
        return table

    def free(self, request_id: str) -> int:
        """Give up all of the request's blocks; returns how many it held (0 if none). A block no one
        else owns is cached if it is findable, else free. The table is given up from its end, so
        the blocks of a prefix, which later requests are likeliest to share, are given up last."""
        table = self._tables.pop(request_id, [])
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.give(block)
        return len(table)

    def owners(self) -> set[str]:
        """The requests holding blocks."""
        return set(self._tables)

    def check_integrity(self) -> None:
        """Every block is owned (its reference count the number of tables holding it), cached or
        free, and exactly one of them; hashes map both ways; nothing else."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block is twice in one table"
            for block in table:
                counts[block] += 1
        assert counts == self._refs, "reference counts differ from the tables holding the blocks"
        free, cached = self._free.check(), list(self._cached)
        unowned = free | set(cached)
        assert not free & set(cached), "a block is both free and cached"
        assert all(counts[b] == 0 for b in unowned), "a free or cached block is owned"
        owned = sum(1 for c in counts if c)
        assert owned + len(free) + len(cached) == self.num_blocks, (
            f"owned {owned} + free {len(free)} + cached {len(cached)} != total {self.num_blocks}"
        )
        assert all(b in self._hash_of for b in cached), "a cached block has no hash"
        assert not any(b in self._hash_of for b in free), "a free block keeps a hash"
        assert {self._by_hash[h]: h for h in self._by_hash} == self._hash_of, "the hash maps disagree"

    def _take(self, after: int | None, want: int) -> range | list[int]:
        """Up to `want` consecutive blocks: from `after` on while they are free, else from the
        longest free run, else one cached block (the least recently used, its hash forgotten)."""
        if after is not None and (end := self._free.end_of_run_at(after)) is not None:
            return self._free.take(after, after, min(want, end - after))
        longest = self._free.longest()
        if longest is not None:
            start, end = longest
            count = min(want, end - start)
            # The request owning the block before the run may grow into it: leave it half the room.
            at = start + (end - start - count) // 2 if start and self._refs[start - 1] else start
            return self._free.take(start, at, count)
        block, _ = self._cached.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._by_hash[h]
        self.evictions += 1
        if self._changes is not None:
            self._changes[h] = False
        return [block]

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)
