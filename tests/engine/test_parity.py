"""Greedy output is token-identical to HF transformers' `generate` on the same checkpoint."""

from __future__ import annotations

import pytest

from common.engine.config import Policy
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import QUESTIONS, check_mixed_batch


def check(engine, hf_generate, prompt, imgs, max_tokens):
    got = engine.generate([prompt], [imgs], SamplingParams(max_tokens=max_tokens))[0]
    assert got.token_ids == hf_generate(prompt, imgs, max_tokens)
    return got


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_single_request(make_engine, hf_generate, images, num_images):
    engine = make_engine()
    prompt = engine.chat_prompt(QUESTIONS[0], num_images)
    check(engine, hf_generate, prompt, images[:num_images], 24)


@pytest.mark.parametrize("policy", list(Policy))
def test_eight_mixed_requests_batched(make_engine, hf_generate, images, policy):
    """Different prompt lengths, image counts and max_tokens, all in flight at once."""
    check_mixed_batch(make_engine(policy=policy), hf_generate, QUESTIONS, images, stride=2)


def test_decode_steps_padded_to_graph_buckets_keep_parity(make_engine, hf_generate, images):
    """Decode-only steps padded as CUDA graphs run them (decode_graphs.py, uncaptured here): rows
    that pad the batch and blocks that pad the context change no token."""
    engine = make_engine(decode_graphs="eager")
    check_mixed_batch(engine, hf_generate, QUESTIONS, images, stride=2)
    assert engine.runner.graphs.runs > 0


def test_chunked_prefill_splits_inside_an_image(make_engine, hf_generate, images):
    """A token budget of 16 is smaller than one image's 49 tokens, so chunks start and end inside it."""
    engine = make_engine(token_budget=16)
    prompt = engine.chat_prompt(QUESTIONS[3], 2)
    req = engine.add_request(prompt, images[:2], SamplingParams(max_tokens=16))
    chunks = []
    while engine.has_unfinished():
        before = req.num_computed_tokens
        engine.step()
        if not req.output_token_ids or len(chunks) < 1 or req.num_computed_tokens - before > 1:
            chunks.append(req.num_computed_tokens - before)
    assert max(chunks) <= 16 and len([c for c in chunks if c > 1]) >= 6
    assert req.output_token_ids == hf_generate(prompt, images[:2], 16)


def test_feature_cache_hit_skips_the_encoder(make_engine, hf_generate, images):
    engine = make_engine()
    prompt = engine.chat_prompt(QUESTIONS[0], 1)
    check(engine, hf_generate, prompt, images[:1], 8)
    encoded_before = engine.features.misses
    req = engine.add_request(engine.chat_prompt(QUESTIONS[1], 1), images[:1], SamplingParams(max_tokens=8))
    assert not req.needs_encode, "the second request should find the image's features in the cache"
    assert engine.features.hits >= 1 and engine.features.misses == encoded_before
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == hf_generate(engine.chat_prompt(QUESTIONS[1], 1), images[:1], 8)


def test_preemption_by_recompute_keeps_outputs_exact(make_engine, hf_generate, images):
    """A KV cache too small for all requests at once forces preemption; outputs must not change."""
    per_block = 2 * 4 * 2 * 16 * 16 * 4  # K and V, 4 layers, 2 kv heads, head dim 16, 16 tokens, fp32
    engine = make_engine(kv_cache_bytes=14 * per_block)
    assert engine.blocks.num_blocks == 14
    prompts = [engine.chat_prompt(QUESTIONS[i], 1 if i % 2 else 0) for i in range(4)]
    imgs = [images[:1] if i % 2 else [] for i in range(4)]
    reqs = [
        engine.add_request(p, im, SamplingParams(max_tokens=40)) for p, im in zip(prompts, imgs, strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must actually preempt"
    for req, p, im in zip(reqs, prompts, imgs, strict=True):
        assert req.output_token_ids == hf_generate(p, im, 40)


def test_disaggregated_e_p_d_hand_offs(make_engine, hf_generate, images):
    """E, P and D as three engines: features and KV move between them, output is unchanged."""
    enc, pre, dec = (make_engine(roles=frozenset({r})) for r in (Role.ENCODE, Role.PREFILL, Role.DECODE))
    prompt = enc.chat_prompt(QUESTIONS[1], 2)
    req = enc.add_request(prompt, images[:2], SamplingParams(max_tokens=20), request_id="r1")
    outs = []
    while enc.has_unfinished():
        outs += enc.step()
    assert [o.next_stage for o in outs] == [Role.PREFILL]
    processed = pre.processor.process(prompt, images[:2])
    for img, done in zip(processed.images, req.images, strict=True):
        img.features, img.pixel_values = done.features, None
    preq = pre.add_request(processed, params=SamplingParams(max_tokens=20), request_id="r1")
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    assert outs[-1].next_stage == Role.DECODE and len(preq.output_token_ids) == 1
    kv = pre.handoff.export_kv("r1", group_size=2)
    assert len(kv) == 2  # 4 layers in groups of 2
    dreq = dec.handoff.add_prefilled("r1", preq.prompt_token_ids, preq.output_token_ids, preq.params, kv)
    pre.abort("r1")  # decode has the KV: the prefill instance lets it go
    assert pre.blocks.num_free == pre.blocks.num_blocks
    while dec.has_unfinished():
        dec.step()
    assert dreq.output_token_ids == hf_generate(prompt, images[:2], 20)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_request_resumed_from_its_streamed_tokens_ends_as_if_never_interrupted(
    make_engine, hf_generate, images, sampling
):
    """A request whose decoder died resumes on another instance from the tokens the client has
    seen: that instance computes them as context and continues. Greedy output still equals HF's,
    and seeded sampling draws what it would have drawn uninterrupted (a draw depends on the seed
    and the token's index, not on which instance samples it)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    if sampling == "seeded":
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=7)
    prompt = make_engine().chat_prompt(QUESTIONS[1], 1)
    (whole,) = make_engine().generate([prompt], [images[:1]], params)
    if sampling == "greedy":
        assert whole.token_ids == hf_generate(prompt, images[:1], 24)
    seen = whole.token_ids[:9]  # what reached the client before the death
    engine = make_engine()
    req = engine.add_request(prompt, images[:1], params, output_token_ids=seen)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert req.output_token_ids == whole.token_ids
    new = [t for o in outs for t in o.new_token_ids]
    assert new == whole.token_ids[9:]  # nothing the client has is sent again
    assert outs[-1].finish_reason == "length"


def test_a_resumed_request_whose_tokens_already_end_it_finishes_without_computing(make_engine):
    engine = make_engine()
    prompt = engine.chat_prompt(QUESTIONS[0], 0)
    req = engine.add_request(prompt, params=SamplingParams(max_tokens=3), output_token_ids=[5, 6, 7])
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert out.num_output_tokens == 3 and req.output_token_ids == [5, 6, 7]
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks
