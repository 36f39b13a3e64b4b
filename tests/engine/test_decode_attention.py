"""Decode attention on a CPU: each decode over its own context, read where it lies in the cache when
its blocks are consecutive and gathered otherwise, against the batched gather path and the varlen
reference."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from common.engine import model_runner
from common.engine.attention import (
    MERGE_FROM_TOKENS,
    DecodeContext,
    PrefillSeq,
    decode_context,
    paged_attention,
    varlen_attention_reference,
)
from common.engine.sampling import SamplingParams
from tests.helpers.attention import BS, DIM, HEADS, KV_HEADS, cache, meta_for, reference
from tests.helpers.engine import QUESTIONS, check_mixed_batch

# Consecutive blocks (read in place), scattered ones (gathered), and a table longer than its context.
TABLES = [[3, 4, 5], [10, 2, 7], [20], [30, 31, 32, 33], [12, 13, 0]]
LENGTHS = [11, 9, 4, 13, 7]


def test_a_decodes_context_is_read_in_place_when_its_blocks_are_one_run_or_a_few_long_ones():
    assert decode_context([3, 4, 5], 11, BS) == DecodeContext(11, runs=((12, 11),))
    assert decode_context([30, 31, 32, 33], 12, BS) == DecodeContext(12, runs=((120, 12),)), "blocks past it"
    assert decode_context([12, 13, 0], 7, BS) == DecodeContext(7, runs=((48, 7),)), "only the blocks it uses"
    scattered = decode_context([10, 2, 7], 9, BS)
    assert scattered.runs is None and scattered.blocks.tolist() == [10, 2, 7]
    assert decode_context([5, 4], 8, BS).runs is None, "descending ids are not one run"
    # A shared prefix's run and the request's own: read in place once the context is long.
    long = MERGE_FROM_TOKENS + 2
    table = [0, 1, *range(50, 50 + long // BS)]
    assert decode_context(table, long, BS) == DecodeContext(long, runs=((0, 8), (200, long - 8)))
    assert decode_context(table, MERGE_FROM_TOKENS - 2, BS).runs is None, "short: gathered"
    five_runs = [0, 2, 4, 6, *range(50, 50 + long // BS)]
    assert decode_context(five_runs, long, BS).runs is None, "too many runs: gathered"


def test_each_decode_attends_to_exactly_its_context():
    k_cache, v_cache = cache()
    q = torch.randn(len(TABLES), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    k, v = torch.randn(len(TABLES), KV_HEADS, DIM), torch.randn(len(TABLES), KV_HEADS, DIM)
    got = paged_attention(q, k, v, k_cache, v_cache, meta_for(TABLES, LENGTHS, per_decode=True))
    # paged_attention wrote each decode's k/v into its last slot first; the reference reads them there.
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, TABLES, LENGTHS), atol=1e-5, rtol=1e-5)


def test_a_long_context_in_several_runs_is_attended_to_where_it_lies():
    """A shared prefix of 2 blocks, then the request's own run; one of three runs; and one whose last
    run is a single token: merged by log-sum-exp, within float rounding of one call over it all."""
    k_cache, v_cache = cache(6)
    n = MERGE_FROM_TOKENS + 10
    tables = [[7, 8, *range(20, 20 + n // BS)], [1, *range(10, 13), *range(40, 40 + n // BS)]]
    tables.append([*range(300, 300 + n // BS), 511])
    lengths = [n, n, (n // BS) * BS + 1]
    meta = meta_for(tables, lengths, per_decode=True)
    assert [len(ctx.runs) for ctx in meta.decode_contexts] == [2, 3, 2]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, HEADS, DIM, generator=gen)
    k, v = torch.randn(3, KV_HEADS, DIM, generator=gen), torch.randn(3, KV_HEADS, DIM, generator=gen)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lengths), atol=1e-5, rtol=1e-5)


@pytest.fixture
def one_thread():
    """SDPA's CPU kernel splits a masked batch's work by thread count: with two threads a batch of two
    decodes sums in another order than one decode alone (1 ulp apart on a 2-core EPYC). The engine's
    bit-exact claims are made per thread count; the lanes of `make test` run one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("length", [1, 4, 13, 16])
def test_in_place_and_gathered_and_batched_give_the_same_bits(length, one_thread):
    """One context, read in place, gathered, and through the batched path: the same numbers in the
    same order, so the same bits (the parity tests' exact matches rest on it)."""
    k_cache, v_cache = cache(2)
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(3)).expand(2, -1, -1).clone()
    tables, lengths = [[6, 7, 8, 9], [6, 7, 8, 9]], [length, length]
    meta = meta_for(tables, lengths, per_decode=True)
    meta.decode_contexts[1] = DecodeContext(length, blocks=torch.tensor([6, 7, 8, 9][: -(-length // BS)]))
    assert meta.decode_contexts[0].runs is not None
    kv = torch.zeros(2, KV_HEADS, DIM)
    kv[:] = k_cache[6 * BS + length - 1]  # both rows write the value already there: the cache stays
    vv = v_cache[6 * BS + length - 1].expand(2, -1, -1).clone()
    per_decode = paged_attention(q, kv, vv, k_cache, v_cache, meta)
    assert torch.equal(per_decode[0], per_decode[1])
    batched = paged_attention(q, kv, vv, k_cache, v_cache, meta_for(tables, lengths, per_decode=False))
    assert torch.equal(per_decode, batched)


def test_decodes_after_a_prefill_chunk_in_one_batch():
    """A chunk of 3 new tokens after 5 cached ones, then two decodes: the decodes' rows are theirs."""
    k_cache, v_cache = cache(4)
    chunk = PrefillSeq(0, 3, torch.arange(16, 24))  # blocks 4 and 5, 8 tokens
    tables, lengths = [[3, 4, 5][:1], [25, 26]], [3, 6]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(5, HEADS, DIM, generator=gen)
    k, v = torch.randn(5, KV_HEADS, DIM, generator=gen), torch.randn(5, KV_HEADS, DIM, generator=gen)
    got = paged_attention(q, k, v, k_cache, v_cache, meta_for(tables, lengths, True, [chunk], 3))
    expected = reference(q[3:], k_cache, v_cache, tables, lengths)
    torch.testing.assert_close(got[3:], expected, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    chunk_ref = varlen_attention_reference(q[:3], k_cache[16:24], v_cache[16:24], *cu, 3, 8, causal=True)
    torch.testing.assert_close(got[:3], chunk_ref, atol=1e-5, rtol=1e-5)


def runs_of(blocks: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in pairwise(blocks))


@pytest.fixture
def found(monkeypatch) -> list[DecodeContext]:
    """Every decode context the engine's runner makes while the test runs."""
    made: list[DecodeContext] = []

    def recorded(table, length, block_size):
        made.append(decode_context(table, length, block_size))
        return made[-1]

    monkeypatch.setattr(model_runner, "decode_context", recorded)
    return made


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_an_engine_reads_its_decodes_contexts_in_place_and_answers_as_hf(
    make_engine, hf_generate, images, found, prefix_caching
):
    """Eight requests of different lengths decoding side by side, growing a block at a time in
    turn: the block manager keeps each one's blocks consecutive, so every decode's context is read
    where it lies — or, where requests share a cached prompt prefix, is that prefix's run and then
    one run of its own — and each answer is still HF's."""
    engine = make_engine(block_size=4, prefix_caching=prefix_caching)
    check_mixed_batch(engine, hf_generate, QUESTIONS, images, stride=2)
    assert len(found) > 100
    scattered = [ctx.blocks.tolist() for ctx in found if ctx.runs is None]
    if not prefix_caching:
        assert not scattered, f"{len(scattered)} of {len(found)} decodes' blocks were scattered"
    else:
        assert scattered, "the requests share their chat template's first tokens"
        assert all(runs_of(blocks) == 2 for blocks in scattered), "more than the prefix and one run"


def test_long_prompts_sharing_a_cached_prefix_are_merged_over_their_runs_and_answer_as_hf(
    make_engine, hf_generate, found
):
    """A long prompt, then two more that begin with most of it: the later ones attach the cached
    blocks and compute their own run elsewhere, so their decodes read two runs, merged — and every
    answer is HF's."""
    engine = make_engine(block_size=4, prefix_caching=True)
    story = " ".join(f"the {w} crossed the river at dawn," for w in ("fox", "hen", "ox", "cat", "owl") * 24)
    prompts = [
        engine.chat_prompt(story + end) for end in (" Who went first?", " Who went last?", " How many?")
    ]
    assert len(engine.processor.process(prompts[0], []).token_ids) > MERGE_FROM_TOKENS
    first = engine.generate(prompts[:1], params=SamplingParams(max_tokens=6))[0]
    assert first.token_ids == hf_generate(prompts[0], [], 6)
    found.clear()
    answers = engine.generate(prompts[1:], params=SamplingParams(max_tokens=6))
    assert [a.token_ids for a in answers] == [hf_generate(p, [], 6) for p in prompts[1:]]
    assert found and all(ctx.runs is not None and len(ctx.runs) == 2 for ctx in found), [
        (ctx.runs and len(ctx.runs), ctx.length) for ctx in found
    ]
