"""An engine's own bookkeeping, checked whole (as mini-sglang's `check_integrity`): tests run it
after every engine they build, and a worker's ledger check (services/worker/ledger.py) runs it too."""

from __future__ import annotations

from collections.abc import Collection

from common.engine.feature_cache import FeatureCache
from common.engine.lifecycle import Lifecycle
from common.engine.request import Status


def check_integrity(held: Lifecycle, features: FeatureCache, landing: Collection[str] = ()) -> None:
    """Blocks and feature cache are consistent; every request held is scheduled or handed off,
    and only requests held own blocks, besides those whose KV is `landing` (kv_landing.py), which
    are not held yet; every running request's blocks cover its tokens."""
    blocks, scheduler, requests = held.blocks, held.scheduler, held.requests
    blocks.check_integrity()
    features.check_integrity()
    scheduled = {r.request_id for r in (*scheduler.waiting, *scheduler.running)}
    handed_off = {rid for rid, r in requests.items() if r.status == Status.HANDED_OFF}
    assert scheduled | handed_off == set(requests), "a request is held but not scheduled"
    assert not scheduled & handed_off, "a handed-off request is still scheduled"
    assert not set(landing) & set(requests), "a request whose KV is landing is already held"
    assert blocks.owners() <= set(requests) | set(landing), "blocks are owned by a request no longer held"
    for req in scheduler.running:
        have = len(blocks.table(req.request_id)) * held.config.block_size
        assert have >= req.num_computed_tokens, f"{req.request_id}: KV blocks do not cover its tokens"
