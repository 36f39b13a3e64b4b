"""The keys prefix caching finds KV blocks by: a hash chain over a request's full blocks.

A block's KV depends on every token before it and on what those tokens stand for. So block i's key
is SHA-256 over block i-1's key, block i's token ids and, for each image whose placeholder tokens
fall in the block, the image's content hash, its shape (token count, patch grid, picture size), for
a clip its timing (the seconds a temporal patch spans, which Qwen2.5-VL's M-RoPE turns into temporal
positions) and the row of its features the block starts at. The same text after another image, or
the same image at another offset, gives other keys. M-RoPE positions and Qwen3-VL's DeepStack inputs
follow from the tokens and images before a position, so the chain covers them. Every ImageInput
field but its pixels and features (its content hash stands for them) is in the key
(tests/engine/test_prefix_keys.py holds that). Keys are full 32-byte digests.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

from common.engine.block_manager import BlockManager
from common.engine.request import IN_PREFIX, Request

ROOT = b"trident prefix cache, v1"


class PrefixLost(Exception):
    """A request admitted with images IN_PREFIX (its sender found their KV cached here) whose prefix
    is gone, or cannot be held: those images' features must come from elsewhere (pulled, or
    computed from their pixels), and the request admitted again with them."""

    def __init__(self, request_id: str, images: list[int]) -> None:
        super().__init__(f"{request_id}: the cached prefix no longer holds images {images}")
        self.images = images


def block_hashes(req: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """The keys of the request's first `num_blocks` full blocks (computed once, kept on the request)."""
    known = req.block_hashes
    if len(known) < num_blocks:
        tokens = req.all_token_ids
        assert num_blocks * block_size <= len(tokens), "only full blocks have keys"
        starts, positions = _image_rows(req)
        for i in range(len(known), num_blocks):
            lo, hi = i * block_size, (i + 1) * block_size
            h = hashlib.sha256(known[-1] if known else ROOT)
            h.update(array("q", tokens[lo:hi]).tobytes())
            first = bisect.bisect_left(positions, lo)
            last = bisect.bisect_left(positions, hi)
            seen: set[int] = set()
            for row in range(first, last):
                k = bisect.bisect_right(starts, row) - 1  # the image this feature row belongs to
                if k not in seen:
                    seen.add(k)
                    img = req.images[k]
                    shape = (
                        img.num_tokens,
                        img.grid_thw,
                        img.image_size,
                        img.video,
                        img.seconds_per_patch,
                        row - starts[k],
                    )
                    h.update(b"image" + img.content_hash.encode() + repr(shape).encode())
            known.append(h.digest())
    return known[:num_blocks]


def _image_rows(req: Request) -> tuple[list[int], list[int]]:
    """Each image's first feature row, and the prompt position of every feature row, in order."""
    if req.image_positions is None or not len(req.image_positions) or not req.images:
        return [], []
    starts, total = [], 0
    for img in req.images:
        starts.append(total)
        total += img.num_tokens
    return starts, req.image_positions.tolist()


class PrefixReuse:
    """Prefix caching as a request sees it: where its computing starts (the scheduler's lookup, as
    it is admitted) and which of its computed blocks are findable (the engine's, as they fill).
    The planner's simulator answers the lookup from a trace instead (common/planner/simulator.py)."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks

    def lookup(self, req: Request) -> tuple[int, int]:
        """A request about to compute its first tokens starts from its longest cached prefix, and
        computes at least its last token (whose logits it samples from). Returns (tokens looked up,
        tokens found), for the hit rate once the request is admitted ((0, 0): no lookup)."""
        blocks = self.blocks
        if not blocks.caching or not req.cacheable or req.num_computed_tokens or blocks.table(req.request_id):
            return 0, 0
        size = blocks.block_size
        found = blocks.longest_prefix(block_hashes(req, (req.num_tokens - 1) // size, size))
        blocks.attach(req.request_id, found)
        req.num_remembered = len(found)  # its attached blocks are findable already
        req.num_computed_tokens = len(found) * size
        return req.num_tokens, req.num_computed_tokens

    def covered(self, req: Request) -> list[int]:
        """The request's images that lie wholly inside the prefix cached now (nothing attached):
        those whose features a prefill instance need not pull. `pin` decides for good at admission."""
        if not self.blocks.caching or not req.cacheable or not req.images:
            return []
        size = self.blocks.block_size
        found = len(self.blocks.longest_prefix(block_hashes(req, (req.num_tokens - 1) // size, size)))
        return [i for i, (_, end) in enumerate(req.image_spans()) if end <= found * size]

    def pin(self, req: Request) -> list[int]:
        """At admission, for a request with images it has no features of (to encode, or IN_PREFIX
        as its sender expects them cached): attach its longest cached prefix now, and each such
        image wholly inside it is IN_PREFIX, neither encoded nor pulled. The prefix then stays
        attached while the request waits (`give_back` keeps it; the engine reserves the rest of
        its prefill at once), so it cannot be evicted under an image that needs it. Returns the
        images IN_PREFIX that lie outside it after all and have no pixels to encode (nothing is
        attached then): their features must come from elsewhere."""
        lacking = [i for i, img in enumerate(req.images) if img.features is None or img.features is IN_PREFIX]
        if not lacking:
            return []
        looked = self.lookup(req)
        spans = req.image_spans()
        inside = {i for i in lacking if spans[i][1] <= req.num_computed_tokens}
        missing = []
        for i in lacking:
            img = req.images[i]
            if i in inside:
                img.features = IN_PREFIX
            elif img.features is IN_PREFIX:
                if img.pixel_values is None:
                    missing.append(i)
                img.features = None
        if missing or not inside:  # nothing to keep the prefix for: found again when it computes
            self.unpin(req)
        else:
            self.admitted(req, looked)
        return missing

    def unpin(self, req: Request) -> None:
        """Give up a prefix `pin` attached (a request not admitted after all); its images want
        their features again."""
        self.blocks.free(req.request_id)
        req.num_computed_tokens = req.num_remembered = req.num_cached_tokens = 0
        for img in req.images:
            if img.features is IN_PREFIX:
                img.features = None

    def admitted(self, req: Request, looked: tuple[int, int]) -> None:
        """Admitted after a `lookup`: count it, and what it found is the request's."""
        if looked[0]:
            self.blocks.count_lookup(*looked)
            req.num_cached_tokens = looked[1]

    def give_back(self, req: Request, running: list[Request]) -> None:
        """Not admitted after all: a request that computed nothing holds no blocks while it waits,
        unless its prefix stands in for images' features (`pin`)."""
        if req.num_computed_tokens and not req.pins_prefix and all(req is not r for r in running):
            self.blocks.free(req.request_id)
            req.num_computed_tokens = req.num_remembered = 0

    def remember(self, req: Request) -> None:
        """Make the request's newly computed full blocks findable by their keys."""
        full = req.num_computed_tokens // self.blocks.block_size
        if self.blocks.caching and req.cacheable and full > req.num_remembered:
            hashes = block_hashes(req, full, self.blocks.block_size)
            self.blocks.remember(req.request_id, hashes, start=req.num_remembered)
            req.num_remembered = full
