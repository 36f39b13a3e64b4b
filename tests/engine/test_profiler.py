"""The budget profiler finds the right budgets on a synthetic latency model, and on the real engine."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import torch

from common.engine.budgets import budget_target, latency_limit, search_budget
from common.engine.profiler import (
    DECODE_EVERY_BATCH_TO,
    DENSE_CONTEXTS,
    BudgetProfiler,
    StageProfile,
    powers_of_two,
)
from common.protocol import StageProfile as StageProfileRecord
from common.protocol import decode as decode_message
from common.roles import Role


@contextmanager
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_latency_limit_by_role_set():
    ep = frozenset({Role.ENCODE, Role.PREFILL})
    assert latency_limit(ep, ttft_slo=2.0, tbt_slo=0.1) == 1.0  # α = 0.5 of TTFT
    assert latency_limit(frozenset({Role.PREFILL}), 2.0, 0.1) == 1.0
    assert latency_limit(frozenset({Role.ENCODE, Role.DECODE}), 2.0, 0.1) == 0.1
    assert latency_limit(frozenset(Role), 2.0, 0.1) == 0.1


def test_search_finds_the_largest_budget_under_the_limit():
    calls = []

    def linear(n: int) -> float:  # 5 ms fixed + 1 ms a token
        calls.append(n)
        return 0.005 + 0.001 * n

    assert search_budget(linear, limit=0.5, hi=8192) == 495
    assert len(calls) <= math.ceil(math.log2(8192)) + 1
    assert search_budget(lambda n: 0.03 * n**0.5, limit=0.3, hi=1000) == 100
    assert search_budget(lambda n: 1.0, limit=0.1, hi=64) == 1  # never zero: the instance must progress


def test_profile_of_the_tiny_engine_round_trips(make_engine):
    engine = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    with one_torch_thread():
        profile = BudgetProfiler(engine, repeats=1).profile(
            ttft_slo=10.0, tbt_slo=1.0, max_images=4, max_tokens=64
        )
    # A generous SLO admits the whole search range.
    assert (profile.image_budget, profile.token_budget) == (4, 64)
    assert profile.roles == ["encode", "prefill"] and profile.latency_limit == 5.0
    assert profile.encode and profile.prefill and profile.decode
    assert StageProfile.from_json(profile.to_json()) == profile
    engine.apply_profile(profile)
    assert engine.scheduler.token_budget == 64 and engine.blocks.num_free == engine.blocks.num_blocks


def test_search_stops_at_the_requested_resolution_inside_a_bracket():
    calls = []

    def linear(n: int) -> float:
        calls.append(n)
        return 0.001 * n

    # Bracket [512, 1023] (512 known good); the answer is 700, wanted to within 32.
    found = search_budget(linear, limit=0.7, hi=1023, lo=512, resolution=32)
    assert 700 - 32 < found <= 700 and all(512 < n <= 1023 for n in calls) and len(calls) <= 4


def test_powers_of_two_end_at_the_cap():
    assert powers_of_two(16, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert powers_of_two(16, 100) == [16, 32, 64, 100]
    assert powers_of_two(1, 1) == [1] and powers_of_two(8, 8) == [8]


def test_profile_curves_cover_the_grid_and_grow_with_size(make_engine):
    engine = make_engine(roles=frozenset(Role), kv_cache_bytes=4 << 20, max_num_seqs=64)
    # One thread and the least of 3 runs a point, so a burst of load from other processes on a shared
    # CPU does not decide a comparison below.
    with one_torch_thread():
        profile = BudgetProfiler(engine, repeats=3).profile(
            ttft_slo=10.0, tbt_slo=5.0, max_images=4, max_tokens=512, encode_curve_to=16
        )
    encode = dict(profile.encode)
    assert set(encode) == {1, 2, 3, 4, 8, 16}  # 1..τe, then powers of two beyond
    prefill = dict(profile.prefill)
    assert set(prefill) == {16, 32, 64, 128, 256, 512}
    decode = {(b, c): s for b, c, s in profile.decode}
    blocks = engine.blocks.num_blocks  # 4 MiB of tiny KV: 256 blocks of 16 tokens
    assert {c for _, c in decode} == {64, 256, 1024}  # each context below max_model_len (2048)
    for k, context in enumerate((64, 256, 1024)):
        batches = sorted(b for b, c in decode if c == context)
        most = min(64, blocks // -(-(context + 1) // 16))
        # Every batch size up to 8 at the shortest contexts, powers of two beyond and elsewhere.
        dense = range(1, min(most, DECODE_EVERY_BATCH_TO) + 1) if k < DENSE_CONTEXTS else ()
        assert batches == sorted({*dense, *powers_of_two(1, most)}), (context, batches)
    # Far-apart points, so timing noise on a shared CPU cannot reorder them.
    assert encode[16] > encode[1] and prefill[512] > prefill[16]
    assert decode[max(b for b, c in decode if c == 64), 64] > decode[1, 64]
    assert profile.num_kv_blocks == blocks and profile.block_size == 16
    assert profile.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4  # K+V × layers × kv heads × head dim × fp32
    assert profile.feature_bytes_per_image_token == 64 * 4  # text hidden × fp32
    assert (profile.max_num_seqs, profile.max_model_len) == (64, 2048)
    record = profile.to_record("p-1", model="tiny-llava", hardware="cpu:test:1")
    assert record.roles == ("decode", "encode", "prefill") and record.num_kv_blocks == blocks
    assert StageProfile.from_record(decode_message(record.to_bytes(), StageProfileRecord)) == profile


def test_budgets_respect_the_limit(make_engine):
    """Under a tight limit the budget is a measured size within it, and every size measured above
    the budget is over it (whatever the timing noise: the search reuses the grid's measurements)."""
    engine = make_engine(roles=frozenset({Role.PREFILL}))
    profiler = BudgetProfiler(engine, repeats=1)
    with one_torch_thread():
        small, large = profiler.prefill_latency(16), profiler.prefill_latency(1024)
        limit = (small + large) / 2  # somewhere inside the grid, whatever this machine's speed
        profile = profiler.profile(ttft_slo=2 * limit, tbt_slo=1.0, max_tokens=1024)
    prefill = dict(profile.prefill)
    assert profile.latency_limit == limit and {16, 32, 64, 128, 256, 512, 1024} <= set(prefill)
    target = budget_target(limit)  # sized with a margin under the limit
    assert prefill[profile.token_budget] <= target < limit
    assert all(s > target for n, s in prefill.items() if n > profile.token_budget)
    engine.apply_profile(profile)
    assert engine.scheduler.token_budget == profile.token_budget


def test_old_profiles_still_decode():
    """Profiles written before the size fields existed (no num_kv_blocks etc.) still read."""
    old = StageProfileRecord(
        profile_id="old", roles=("encode",), latency_limit=1.0, image_budget=2, token_budget=0
    )
    assert decode_message(old.to_bytes(), StageProfileRecord).num_kv_blocks == 0
    legacy = {
        "roles": ["encode"],
        "latency_limit": 1.0,
        "image_budget": 2,
        "token_budget": 0,
        "encode": [[1, 0.1]],
    }
    assert StageProfile.from_json(json.dumps(legacy)).encode == [(1, 0.1)]


def test_a_second_pass_over_the_decode_grid_keeps_the_lesser_time(make_engine):
    """A burst of other work during the first pass (here: a point timed 10× slow) is not kept."""
    engine = make_engine(roles=frozenset({Role.DECODE}))
    profiler = BudgetProfiler(engine, repeats=1)
    with one_torch_thread():
        profiler.decode_latency(1, 64)
        profiler.decode_latency(2, 64)
        first = dict(profiler.curves["decode"])
        profiler.curves["decode"][2, 64] *= 10  # as if another process had held the core
        profiler.decode_again()
    again = profiler.curves["decode"]
    assert set(again) == set(first) and again[2, 64] < 10 * first[2, 64]
    assert all(again[k] <= v for k, v in first.items() if k != (2, 64))
