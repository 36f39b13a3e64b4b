"""A KV cache in half precision under a float32 model (EngineConfig.kv_cache_dtype): keys and values
are written rounded to its dtype, every attention path reads them back to within that rounding, it
holds twice the blocks in the same bytes, and KV moves between caches of either dtype."""

from __future__ import annotations

import pytest
import torch

from common.engine.attention import MERGE_FROM_TOKENS, PrefillSeq, paged_attention, varlen_attention_reference
from common.engine.config import EngineConfig
from common.engine.kv_cache import KVCache, KVSpec
from common.engine.sampling import SamplingParams
from services.settings import WorkerSettings
from services.worker.engine_settings import engine_config
from tests.helpers.attention import BS, DIM, HEADS, KV_HEADS, cache, meta_for, reference

# Half precision keeps 11 significant bits (float16) or 8 (bfloat16); queries are rounded as well
# on the CPU decode path. Attention outputs are averages of values of magnitude ~1.
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 3e-2}
HALF = list(TOLERANCE)


def half_cache(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = cache(seed)
    return k_cache.to(dtype), v_cache.to(dtype)


def new_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, HEADS, DIM, generator=gen),
        torch.randn(n, KV_HEADS, DIM, generator=gen),
        torch.randn(n, KV_HEADS, DIM, generator=gen),
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("per_decode", [True, False], ids=["each", "batched"])
def test_decodes_read_a_half_precision_cache(dtype, per_decode):
    """In place, gathered (scattered blocks) and the batched path: float32 out, within rounding of
    the reference over the same (rounded) cache, and each new key and value stored rounded."""
    k_cache, v_cache = half_cache(dtype, 0)
    tables, lengths = [[3, 4, 5], [10, 2, 7], [20]], [11, 9, 4]
    q, k, v = new_kv(3, 1)
    meta = meta_for(tables, lengths, per_decode=per_decode)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    assert got.dtype == torch.float32
    slots = meta.slot_mapping
    assert torch.equal(k_cache[slots], k.to(dtype)) and torch.equal(v_cache[slots], v.to(dtype))
    want = reference(q, k_cache.float(), v_cache.float(), tables, lengths)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", HALF)
def test_a_long_context_in_runs_merged_from_a_half_precision_cache(dtype):
    k_cache, v_cache = half_cache(dtype, 6)
    n = MERGE_FROM_TOKENS + 10
    tables, lengths = [[7, 8, *range(20, 20 + n // BS)]], [n]
    meta = meta_for(tables, lengths, per_decode=True)
    assert len(meta.decode_contexts[0].runs) == 2
    q, k, v = new_kv(1, 7)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    want = reference(q, k_cache.float(), v_cache.float(), tables, lengths)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_a_prefill_chunk_reads_a_half_precision_cache(dtype):
    """Three new tokens after five cached ones: the chunk attends to all eight as stored."""
    k_cache, v_cache = half_cache(dtype, 4)
    chunk = PrefillSeq(0, 3, torch.arange(16, 24))
    q, k, v = new_kv(3, 5)
    meta = meta_for([], [], per_decode=True, prefills=[chunk], num_prefill=3)
    meta.slot_mapping = torch.arange(21, 24)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    cu = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    ks, vs = k_cache[16:24].float(), v_cache[16:24].float()
    want = varlen_attention_reference(q, ks, vs, *cu, 3, 8, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # the queries stay float32 here


def test_kv_moves_between_caches_of_either_dtype():
    """A float32 prefill instance's export lands in a float16 decoder's cache rounded, and back."""
    spec = KVSpec(num_layers=3, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS, dtype=torch.float32)
    wide = KVCache(spec, 8)
    narrow = KVCache(KVSpec(**{**spec.__dict__, "dtype": torch.float16}), 8)
    assert narrow.spec.bytes_per_block * 2 == spec.bytes_per_block
    wide.kv.normal_(generator=torch.Generator().manual_seed(0))
    exported = wide.export_blocks([1, 4], range(0, 3))
    narrow.import_blocks([6, 2], range(0, 3), exported)
    assert torch.equal(narrow.export_blocks([6, 2], range(0, 3)), exported.to(torch.float16))
    wide.import_blocks([0, 7], range(0, 3), narrow.export_blocks([6, 2], range(0, 3)))
    assert torch.equal(wide.export_blocks([0, 7], range(0, 3)), exported.to(torch.float16).float())


def test_unknown_kv_cache_dtypes_are_refused_and_the_setting_reaches_the_engine(monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float32, bfloat16, float16"):
        EngineConfig(kv_cache_dtype="int8")
    roles = frozenset(EngineConfig().roles)
    assert engine_config(WorkerSettings(), roles).kv_cache_dtype is None  # auto: the model's
    monkeypatch.setenv("TRIDENT_KV_CACHE_DTYPE", "float16")
    assert engine_config(WorkerSettings(), roles).kv_cache_dtype == "float16"


def test_an_engine_with_a_float16_cache_holds_twice_the_blocks_and_answers_close_to_float32(
    make_engine, images
):
    """The same requests through a float32 cache and a float16 one, greedy: the float16 cache has
    twice the blocks in the same bytes, the same tokens, and at every position the float32 engine's five
    most likely tokens within 0.05 nats of their log-probabilities there."""
    prompts, runs = [("Tell me a long story about a boat", 1), ("Hi", 0), ("What is in the picture?", 2)], {}
    for dtype in (None, "float16"):
        engine = make_engine(kv_cache_dtype=dtype)
        seen: list[torch.Tensor] = []
        run = engine.runner.run

        def recording(batch, run=run, seen=seen):
            result = run(batch)
            if result.logits is not None:
                seen.extend(result.logits.log_softmax(-1))
            return result

        engine.runner.run = recording
        done = [
            engine.generate(
                [engine.chat_prompt(text, n)], [images[:n]], SamplingParams(max_tokens=16, ignore_eos=True)
            )[0]
            for text, n in prompts
        ]
        runs[dtype] = (engine, [d.token_ids for d in done], seen)
    (wide, wide_ids, wide_lp), (narrow, narrow_ids, narrow_lp) = runs[None], runs["float16"]
    assert narrow.cache.kv.dtype == torch.float16 and wide.cache.kv.dtype == torch.float32
    assert narrow.cache.num_blocks == 2 * wide.cache.num_blocks
    assert narrow_ids == wide_ids
    assert len(narrow_lp) == len(wide_lp) == 48
    worst = 0.0
    for a, b in zip(narrow_lp, wide_lp, strict=True):
        top = b.topk(5).indices  # the tokens that could be picked; far-off ones move more, harmlessly
        worst = max(worst, (a[top] - b[top]).abs().max().item())
    assert worst < 0.05, worst


def test_decode_steps_padded_to_graph_buckets_read_a_float16_cache(make_engine, images):
    """The padded batched path (decode_graphs.py, uncaptured on a CPU) masks in the queries' dtype
    over a half-precision cache, and answers as the float32 engine does."""
    answers = []
    for overrides in ({}, {"kv_cache_dtype": "float16", "decode_graphs": "eager"}):
        engine = make_engine(**overrides)
        prompt = engine.chat_prompt("Tell me a long story about a boat", 1)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        answers.append(engine.generate([prompt], [images[:1]], params)[0].token_ids)
    assert engine.runner.graphs.runs > 0
    assert answers[1] == answers[0]
