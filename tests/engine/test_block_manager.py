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


def test_a_request_grows_into_the_blocks_after_its_own(blocks):
    assert blocks.allocate("a", 5) == [0, 1]
    # b starts in the middle of the room left, so a can grow into the block before it.
    assert blocks.allocate("b", 4) == [3]
    assert blocks.allocate("a", 8) == [0, 1]  # already covered
    assert blocks.allocate("a", 9) == [0, 1, 2]  # one more token: the next block
    assert blocks.num_free == 2


def test_a_request_whose_next_block_is_taken_goes_on_where_the_room_is(blocks):
    assert blocks.allocate("a", 8) == [0, 1]
    assert blocks.allocate("b", 4) == [3]
    assert blocks.allocate("a", 12) == [0, 1, 2]
    assert blocks.allocate("a", 20) == [0, 1, 2, 4, 5]  # past b's block, into the run after it


def test_exhaustion_returns_none_and_changes_nothing(blocks):
    assert blocks.allocate("a", 16) == [0, 1, 2, 3]
    assert blocks.allocate("b", 12) is None
    assert blocks.table("b") == [] and blocks.num_free == 2
    assert blocks.can_fit("b", 8) and not blocks.can_fit("b", 9)


def test_freed_blocks_join_the_runs_beside_them(blocks):
    blocks.allocate("a", 8)
    blocks.allocate("b", 4)
    assert blocks.table("b") == [3]
    assert blocks.free("a") == 2
    assert blocks.free("a") == 0
    assert blocks._free.runs() == [(0, 3), (4, 6)]
    assert blocks.allocate("c", 16) == [0, 1, 2, 4]  # the longest run first, then the next
    blocks.free("b")
    blocks.free("c")
    assert blocks._free.runs() == [(0, 6)]


def test_requests_decoding_side_by_side_each_keep_one_run():
    """Eight prompts of 33 blocks admitted one after another, then every request growing by a
    block in turn, as decodes do: each table stays consecutive ids, so attention reads it in place."""
    manager = BlockManager(num_blocks=1024, block_size=16)
    for i in range(8):
        manager.allocate(f"r{i}", 33 * 16)
    for step in range(1, 41):
        for i in range(8):
            manager.allocate(f"r{i}", (33 + step) * 16)
    for i in range(8):
        table = manager.table(f"r{i}")
        assert table == list(range(table[0], table[0] + 73)), f"r{i} is not one run"
    manager.check_integrity()


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
