"""The keys prefix caching finds KV blocks by: a hash chain over a request's full blocks.

A block's KV depends on every token before it and on what those tokens stand for. So block i's key
is SHA-256 over block i-1's key, block i's token ids and, for each image whose placeholder tokens
fall in the block, the image's content hash, its shape (token count, patch grid, picture size) and
the row of its features the block starts at. The same text after another image, or the same image
at another offset, gives other keys. M-RoPE positions and Qwen3-VL's DeepStack inputs follow from
the tokens and images before a position, so the chain covers them. Keys are full 32-byte digests.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

from common.engine.request import Request

ROOT = b"trident prefix cache, v1"


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
                    shape = (img.num_tokens, img.grid_thw, img.image_size, row - starts[k])
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
