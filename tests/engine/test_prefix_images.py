"""An image wholly inside a request's cached prefix is neither encoded nor pulled: its KV is there
(PrefixReuse.pin). Admission attaches the prefix, so it cannot be evicted while the request waits;
when it is gone before admission the engine says which images need their features (PrefixLost);
and a request whose prefix stands in for an image it has no pixels of is never preempted. Every
answer equals HF's on the whole conversation."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.block_manager import blocks_needed
from common.engine.prefix import PrefixLost
from common.engine.processor import ProcessedPrompt
from common.engine.request import IN_PREFIX, ImageInput
from common.engine.sampling import SamplingParams
from common.roles import Role

PER_BLOCK = 2 * 4 * 2 * 16 * 16 * 4  # tiny-llava: K and V, 4 layers, 2 kv heads, head dim 16, 16 tokens, fp32
E, PD = frozenset({Role.ENCODE}), frozenset({Role.PREFILL, Role.DECODE})


def turns(engine, n: int) -> str:
    """The prompt of turn n + 1: an image in the first user message, an answer after each."""
    messages = []
    for t in range(n + 1):
        content = ([{"type": "image"}] if t == 0 else []) + [{"type": "text", "text": f"Question {t}: why?"}]
        messages.append({"role": "user", "content": content})
        if t < n:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Because {t}."}]})
    return engine.processor.chat_prompt(messages)


def run(engine, req):
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return req


def test_an_image_inside_the_cached_prefix_is_not_encoded_again(make_engine, hf_generate, images):
    """No feature cache to find the image in: before, turn 2 encoded its history image again."""
    engine = make_engine(feature_cache_bytes=0)
    params = SamplingParams(max_tokens=8)
    run(engine, engine.add_request(turns(engine, 0), images[:1], params))
    assert engine.runner.images_encoded == 1
    second = run(engine, engine.add_request(turns(engine, 1), images[:1], params))
    assert engine.runner.images_encoded == 1, "the history image was encoded again"
    assert second.num_cached_tokens >= 64  # the image's blocks, found
    assert second.output_token_ids == hf_generate(turns(engine, 1), images[:1], 8)


def encoded(enc, prompt: str, imgs) -> ProcessedPrompt:
    """The prompt processed, its images' features from an encode-only engine (the encoder's part)."""
    processed = enc.processor.process(prompt, imgs)
    req = run(enc, enc.add_request(processed, params=SamplingParams(max_tokens=1)))
    for img in processed.images:
        img.pixel_values = None
    enc.abort(req.request_id)
    return processed


def in_prefix(processed: ProcessedPrompt, indices: list[int]) -> ProcessedPrompt:
    """The same prompt with the images at `indices` sent without features: expected in the prefix."""
    images = [
        ImageInput(img.content_hash, img.num_tokens, features=IN_PREFIX if i in indices else img.features)
        for i, img in enumerate(processed.images)
    ]
    return ProcessedPrompt(processed.token_ids, images, processed.image_positions)


def test_a_turn_whose_image_is_in_the_prefix_runs_without_its_features_and_reserves_its_length(
    make_engine, hf_generate, images
):
    """On an instance that prefills and decodes (a decoder continuing turns, an EPD): turn 2 comes
    without the image's features or pixels; it answers as HF, and, since it could not be computed
    again, holds its whole length from admission (never a preemption victim)."""
    enc, pd = make_engine(roles=E), make_engine(roles=PD)
    run(pd, pd.add_request(encoded(enc, turns(pd, 0), images[:1]), params=SamplingParams(max_tokens=8)))
    turn = encoded(enc, turns(pd, 1), images[:1])
    assert pd.handoff.cached_images(turn) == [0]
    req = pd.add_request(in_prefix(turn, [0]), params=SamplingParams(max_tokens=8))
    assert req.images[0].features is IN_PREFIX and not req.recomputable
    size = pd.config.block_size
    assert len(pd.blocks.table(req.request_id)) == blocks_needed(len(req.prompt_token_ids) + 8, size)
    run(pd, req)
    assert req.output_token_ids == hf_generate(turns(pd, 1), images[:1], 8)
    assert pd.blocks.num_free == pd.blocks.num_blocks


def test_on_a_prefill_instance_a_turn_takes_its_whole_prefill_at_admission_or_is_refused(
    make_engine, hf_generate, images
):
    """Prefill-only: the turn whose image is in the prefix takes every block its prompt needs as
    it is admitted, so it never waits for blocks with the prefix attached (where another prefill's
    chunks might wait for them too); when they are not free it is refused (PrefixLost), holding
    nothing, and the prefix stays cached for when it comes back with its features."""
    enc = make_engine(roles=E)
    p = make_engine(roles=frozenset({Role.PREFILL}), kv_cache_bytes=10 * PER_BLOCK)
    first = p.add_request(encoded(enc, turns(p, 0), images[:1]), params=SamplingParams(max_tokens=8))
    run(p, first)
    p.abort(first.request_id)  # decode has its KV: the prompt's blocks stay cached
    turn = encoded(enc, turns(p, 1), images[:1])
    req = run(p, p.add_request(in_prefix(turn, [0]), params=SamplingParams(max_tokens=8), request_id="t2"))
    size = p.config.block_size
    assert req.num_cached_tokens == 4 * size and req.output_token_ids == hf_generate(
        turns(p, 1), images[:1], 1
    )
    p.abort("t2")
    free = p.blocks.num_free - 4  # all but the prefix's 4 blocks, which are the last to go
    words = p.processor.process(p.chat_prompt("Count slowly to one hundred. " * 20), []).token_ids
    hog = ProcessedPrompt(words[: free * size - 1], [], torch.zeros(0, dtype=torch.long))
    hogged = run(p, p.add_request(hog, params=SamplingParams(max_tokens=2)))  # handed off: KV kept
    assert p.blocks.num_free == 4 and p.blocks.table(hogged.request_id)
    assert p.handoff.cached_images(turn) == [0]
    with pytest.raises(PrefixLost):
        p.add_request(in_prefix(turn, [0]), params=SamplingParams(max_tokens=8), request_id="t3")
    assert not p.blocks.table("t3") and p.handoff.cached_images(turn) == [0]


def test_a_prefix_gone_before_admission_names_the_images_that_need_features(make_engine, images):
    """Checked as cached, then evicted by another request's allocation before the admission: the
    engine refuses it naming the image (the handler pulls its features and admits it again), and
    holds nothing of it."""
    enc = make_engine(roles=E)
    pd = make_engine(roles=PD, kv_cache_bytes=8 * PER_BLOCK)
    run(pd, pd.add_request(encoded(enc, turns(pd, 0), images[:1]), params=SamplingParams(max_tokens=2)))
    turn = encoded(enc, turns(pd, 1), images[:1])
    assert pd.handoff.cached_images(turn) == [0]
    words = pd.processor.process(pd.chat_prompt("Count slowly to one hundred. " * 20), []).token_ids
    hog = ProcessedPrompt(words[: pd.blocks.num_blocks * 16 - 1], [], torch.zeros(0, dtype=torch.long))
    run(pd, pd.add_request(hog, params=SamplingParams(max_tokens=1)))  # took every block, cached ones too

    assert pd.handoff.cached_images(turn) == []
    with pytest.raises(PrefixLost) as lost:
        pd.add_request(in_prefix(turn, [0]), params=SamplingParams(max_tokens=2), request_id="t2")
    assert lost.value.images == [0]
    assert "t2" not in pd.requests and not pd.blocks.table("t2")
    again = run(pd, pd.add_request(turn, params=SamplingParams(max_tokens=2), request_id="t2"))
    assert again.finish_reason is not None
    pd.check_integrity()


@pytest.mark.slow  # about a minute of steps: the cases above hold each path in the fast tier
def test_random_turns_under_kv_pressure_answer_as_hf_and_keep_the_engine_consistent(
    make_engine, hf_generate, images
):
    """Conversations whose history image lies in the cached prefix, stepped, cancelled and
    preempted at random on a KV cache too small for all: a pinned prefix is kept while its request
    waits, a preempted one encodes its image again, the integrity check holds at every step and
    every answer not cancelled is HF's."""
    engine = make_engine(kv_cache_bytes=12 * PER_BLOCK, token_budget=32, feature_cache_bytes=0)
    rng = random.Random(48)
    prompts = [turns(engine, n) for n in range(3)]
    added, cancelled = [], set()
    for _ in range(100):
        roll = rng.random()
        live = [r for r, _ in added if r.request_id in engine.requests]
        if roll < 0.3 and len(live) < 5:
            prompt = rng.choice(prompts)
            req = engine.add_request(prompt, images[:1], SamplingParams(max_tokens=rng.randint(1, 40)))
            added.append((req, prompt))
        elif roll < 0.38 and live:
            victim = rng.choice(live)
            cancelled.add(victim.request_id)
            engine.abort(victim.request_id)
        engine.step()
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert sum(r.num_preemptions for r, _ in added) > 0, "the test must preempt"
    assert engine.runner.images_encoded < len(added)  # history images found in the prefix
    for req, prompt in added:
        if req.request_id not in cancelled:
            want = hf_generate(prompt, images[:1], 40)[: req.params.max_tokens]
            assert req.output_token_ids == want, req.request_id
