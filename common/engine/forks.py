"""n choices from one prefill: a request that asks for n > 1 is prefilled once, and where its first
token is sampled it forks into n requests — itself as choice 0, and n - 1 copies, each an ordinary
request from then on (its own id, `choice_id`; its own seed, `SamplingParams.for_choice`).

A copy shares the prompt's full KV blocks with the request it came from (the block manager counts
their owners, as it does for a shared prefix) and gets its own copy of the last, partial block,
which its answer is written after. Every copy samples its first token from the same logits row,
in the same step. A copy that finds no free block for that partial block waits instead, as a new
request over the same prompt: the prefix cache gives it the shared blocks and it computes only the
rest (with prefix caching off, all of it).
"""

from __future__ import annotations

from common.engine.kv_cache import KVCache
from common.engine.lifecycle import Lifecycle
from common.engine.request import Request, Status
from common.protocol.sampling import SamplingParams, choice_id


def forks_due(req: Request) -> bool:
    """Whether `req` forks at the token about to be sampled: n > 1, and its first one."""
    return req.params.n > 1 and not req.output_token_ids


def fork(lifecycle: Lifecycle, cache: KVCache | None, req: Request) -> list[tuple[int, Request, bool]]:
    """Fork `req` (whose prompt is computed, its first token not yet sampled) into its n choices:
    for each copy, (its choice index, it, whether it samples now from `req`'s row — else it waits
    to prefill)."""
    asked = req.params
    req.params = asked.for_choice(0)
    req.sampler = lifecycle.sampler_for(req.params)
    copies = []
    for index in range(1, asked.n):
        copy = _copy(req, index, asked)
        copy.unclaimed = True
        lifecycle.admit(copy)
        now = cache is not None and _share_blocks(lifecycle, cache, req, copy)
        if now:
            copy.status = Status.RUNNING
            lifecycle.requests[copy.request_id] = copy
            lifecycle.scheduler.add_running(copy)
        else:
            lifecycle.enter(copy)
        copies.append((index, copy, now))
    return copies


def _copy(req: Request, index: int, asked: SamplingParams) -> Request:
    """Choice `index` of `req`: the same prompt and images, its own id and seed, nothing computed."""
    return Request(
        choice_id(req.request_id, index),
        list(req.prompt_token_ids),
        asked.for_choice(index),
        images=list(req.images),
        image_positions=req.image_positions,
        mrope_positions=req.mrope_positions,
        rope_delta=req.rope_delta,
        block_hashes=list(req.block_hashes),
        cacheable=req.cacheable,
        num_cached_tokens=req.num_cached_tokens,
    )


def _share_blocks(lifecycle: Lifecycle, cache: KVCache, req: Request, copy: Request) -> bool:
    """Give `copy` the prompt's KV: `req`'s full blocks shared, its partial last block copied.
    False (and nothing held) when no block is free for that copy."""
    blocks, size = lifecycle.blocks, lifecycle.config.block_size
    table = blocks.table(req.request_id)
    prompt = len(req.prompt_token_ids)
    full = prompt // size
    blocks.attach(copy.request_id, table[:full])
    if blocks.allocate(copy.request_id, prompt) is None:
        blocks.free(copy.request_id)
        return False
    if prompt % size:
        cache.copy_block(table[full], blocks.table(copy.request_id)[full])
    copy.num_computed_tokens = prompt
    copy.num_remembered = min(req.num_remembered, full)
    return True
