"""Block manager, KV cache export/import and feature cache, with exact ids and eviction order."""

from __future__ import annotations

import pytest
import torch

from common.engine.block_manager import BlockManager
from common.engine.feature_cache import FeatureCache
from common.engine.kv_cache import KVCache, KVSpec, layer_groups, num_blocks_for


@pytest.fixture
def blocks():
    manager = BlockManager(num_blocks=6, block_size=4)
    yield manager
    manager.check_integrity()


def test_allocation_hands_out_lowest_ids_first(blocks):
    assert blocks.allocate("a", 5) == [0, 1]
    assert blocks.allocate("b", 4) == [2]
    assert blocks.allocate("a", 8) == [0, 1]  # already covered
    assert blocks.allocate("a", 9) == [0, 1, 3]  # one more token: one more block
    assert blocks.num_free == 2


def test_exhaustion_returns_none_and_changes_nothing(blocks):
    assert blocks.allocate("a", 16) == [0, 1, 2, 3]
    assert blocks.allocate("b", 12) is None
    assert blocks.table("b") == [] and blocks.num_free == 2
    assert blocks.can_fit("b", 8) and not blocks.can_fit("b", 9)


def test_freed_blocks_are_reused_after_the_untouched_ones(blocks):
    blocks.allocate("a", 8)
    blocks.allocate("b", 4)
    assert blocks.free("a") == 2
    assert blocks.free("a") == 0
    assert blocks.allocate("c", 16) == [3, 4, 5, 0]


def test_integrity_catches_a_double_owned_block(blocks):
    blocks.allocate("a", 4)
    blocks._tables["b"] = [0]  # held by a second table behind the counts' back
    with pytest.raises(AssertionError, match="reference counts differ"):
        blocks.check_integrity()
    del blocks._tables["b"]


def test_kv_export_import_round_trip_per_layer_group():
    spec = KVSpec(num_layers=5, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    src, dst = KVCache(spec, 8), KVCache(spec, 8)
    src.kv.copy_(torch.randn_like(src.kv))
    groups = layer_groups(5, 2)
    assert groups == [range(0, 2), range(2, 4), range(4, 5)]
    buffers = [src.export_blocks([5, 1, 6], g) for g in groups]
    assert [tuple(b.shape) for b in buffers] == [(2, 2, 3, 4, 2, 4), (2, 2, 3, 4, 2, 4), (1, 2, 3, 4, 2, 4)]
    assert all(b.is_contiguous() for b in buffers)
    for g, b in zip(groups, buffers, strict=True):
        dst.import_blocks([0, 2, 3], g, b)
    assert torch.equal(dst.kv[:, :, [0, 2, 3]], src.kv[:, :, [5, 1, 6]])
    assert dst.kv[:, :, [1, 4, 5, 6, 7]].abs().sum() == 0
    with pytest.raises(ValueError, match="does not match"):
        dst.import_blocks([0, 2], groups[0], buffers[0])


def test_kv_capacity_from_a_byte_cap():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * 16 * 2
    assert num_blocks_for(spec, 10 * spec.bytes_per_block + 1) == 10


def feats(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # n * 16 bytes


def test_feature_cache_evicts_least_recently_used():
    cache = FeatureCache(capacity_bytes=64)
    assert cache.put("a", feats(1)) and cache.put("b", feats(1)) and cache.put("c", feats(2))
    assert cache.get("a") is not None  # a becomes most recent
    assert cache.put("d", feats(1))  # over 64 bytes: evicts b, the least recent
    assert cache.keys() == ["c", "a", "d"]
    assert cache.get("b") is None and (cache.hits, cache.misses) == (1, 1)
    assert not cache.put("huge", feats(5))
    cache.check_integrity()
    assert cache.used_bytes == 64


def test_feature_cache_replacing_a_key_keeps_the_byte_count():
    cache = FeatureCache(capacity_bytes=64)
    cache.put("a", feats(2))
    cache.put("a", feats(1))
    assert cache.used_bytes == 16 and len(cache) == 1
    cache.check_integrity()
