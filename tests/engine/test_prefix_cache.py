"""Prefix caching: full KV blocks found again by the hash chain of what they hold (prefix.py), shared
with reference counts, kept until an allocation needs them (block_manager.py) — and greedy answers
the same as without it, equal to HF's on the whole conversation, for every family."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.checkpoints import write_checkpoint
from common.engine.block_manager import BlockManager
from common.engine.config import Policy
from common.engine.prefix import block_hashes
from common.engine.processor import ProcessedPrompt
from common.engine.request import ImageInput, Request
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import engines, hf_greedy_ids
from tests.helpers.images import make_image

BS = 4  # block size of the unit tests


def request(tokens: list[int], images: list[tuple[str, int, int]] = ()) -> Request:
    """A request over `tokens` whose images are (content hash, first position, token count)."""
    imgs = [ImageInput(content_hash=h, num_tokens=n) for h, _, n in images]
    positions = [p for _, start, n in images for p in range(start, start + n)]
    return Request(
        "r", list(tokens), SamplingParams(), imgs,
        image_positions=torch.tensor(positions, dtype=torch.long) if positions else None,
    )  # fmt: skip


# -- the keys ------------------------------------------------------------------------------------


def test_keys_chain_and_see_what_image_tokens_stand_for():
    text = list(range(100, 116))
    same = block_hashes(request(text), 4, BS)
    assert same == block_hashes(request(text), 4, BS) and len(set(same)) == 4
    assert all(len(h) == 32 for h in same)  # full SHA-256 digests
    other_last = block_hashes(request([*text[:-1], 7]), 4, BS)
    assert other_last[:3] == same[:3] and other_last[3] != same[3]
    other_first = block_hashes(request([7, *text[1:]]), 4, BS)
    assert not set(other_first) & set(same), "a change in block 0 changes every later key"

    # The same tokens (placeholders included) with another image: other keys from its first block on.
    ids = [1, 2, 9, 9, 9, 9, 9, 9, 3, 4, 5, 6]
    a = block_hashes(request(ids, [("cat", 2, 6)]), 3, BS)
    b = block_hashes(request(ids, [("dog", 2, 6)]), 3, BS)
    assert a[0] != b[0] and a[2] != b[2]
    # The same image at another offset: other keys too, though the block's tokens are the same.
    shifted = [1, 9, 9, 9, 9, 9, 9, 2, 3, 4, 5, 6]
    c = block_hashes(request(shifted, [("cat", 1, 6)]), 3, BS)
    assert not set(c) & set(a)


def test_keys_are_computed_once_and_kept_on_the_request():
    req = request(list(range(40)))
    first = block_hashes(req, 3, BS)
    assert req.block_hashes == first
    more = block_hashes(req, 6, BS)
    assert more[:3] == first and len(req.block_hashes) == 6
    with pytest.raises(AssertionError, match="full blocks"):
        block_hashes(req, 11, BS)


# -- the block manager ---------------------------------------------------------------------------


def test_shared_blocks_are_counted_and_cached_until_needed_least_recent_first():
    m = BlockManager(6, BS, caching=True)
    m.allocate("a", 8)
    m.remember("a", [b"k0", b"k1"])
    assert m.longest_prefix([b"k0", b"k1", b"k2"]) == [0, 1]
    m.attach("b", [0, 1])
    m.allocate("b", 12)
    m.count_lookup(12, 8)
    assert m.table("b") == [0, 1, 2] and m.hit_tokens == 8
    m.check_integrity()
    m.free("a")  # shared: still owned by b
    assert m.num_free == 3
    m.check_integrity()
    m.free("b")  # given up from the end: block 1 is cached before block 0, so evicted before it
    assert m.num_free == 6 and m.num_cached == 2
    m.check_integrity()
    m.allocate("c", 16)  # the 4 free blocks, then the cached ones, least recently used first
    assert m.table("c") == [2, 3, 4, 5] and m.evictions == 0
    m.allocate("c", 20)
    assert m.table("c")[-1] == 1 and m.evictions == 1
    assert m.longest_prefix([b"k0", b"k1"]) == [0], "k1's block was taken; k0's is still there"
    m.check_integrity()
    assert m.allocate("d", 8) is None, "one block left, and it is not enough"


def test_a_duplicate_block_stays_unfindable_and_free_blocks_keep_no_key():
    m = BlockManager(4, BS, caching=True)
    m.allocate("a", 4)
    m.allocate("b", 4)
    m.remember("a", [b"k"])
    m.remember("b", [b"k"])  # computed twice side by side: the first copy is the one found
    assert m.longest_prefix([b"k"]) == [0]
    m.free("b")
    assert m.num_cached == 1 and m.num_free == 3
    m.check_integrity()


def test_without_caching_nothing_is_found_or_kept():
    m = BlockManager(4, BS, caching=False)
    m.allocate("a", 8)
    m.remember("a", [b"k0", b"k1"])
    m.free("a")
    assert m.longest_prefix([b"k0"]) == [] and m.num_cached == 0
    m.check_integrity()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("aftr"), st.integers(0, 5), st.integers(1, 24)), max_size=60))
def test_random_sequences_keep_the_blocks_consistent(ops):
    """Allocate (after a cached prefix), free, remember and grow in any order: after each, every
    block is owned (its count = tables holding it), cached or free, and exactly one of them."""
    m = BlockManager(10, BS, caching=True)
    keys = {i: [f"p{i % 3}-{j}".encode() for j in range(8)] for i in range(6)}  # three shared prefixes
    for op, i, n in ops:
        rid = f"r{i}"
        if op == "a" and not m.table(rid):
            found = m.longest_prefix(keys[i][: (n - 1) // BS])
            m.attach(rid, found)
            if m.allocate(rid, n) is None:
                m.free(rid)
        elif op == "f":
            m.free(rid)
        elif op == "t" and m.table(rid):
            full = min(len(m.table(rid)), len(keys[i]))
            m.remember(rid, keys[i][:full])
        elif op == "r" and m.table(rid):
            m.allocate(rid, len(m.table(rid)) * BS + n)
        m.check_integrity()
    for i in range(6):
        m.free(f"r{i}")
    m.check_integrity()
    assert m.num_free == 10


# -- the engine ----------------------------------------------------------------------------------

PRESETS = [
    "tiny-llava",
    "tiny-llava-next",
    "tiny-qwen2-vl",
    pytest.param("tiny-qwen2.5-vl", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3-vl", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=PRESETS)
def family(request, tmp_path_factory):
    """(checkpoint, HF model) of one family's tiny preset."""
    from transformers import AutoModelForImageTextToText

    path = write_checkpoint(tmp_path_factory.mktemp("prefix") / request.param, request.param, seed=0)
    return path, AutoModelForImageTextToText.from_pretrained(path).eval()


def conversation(engine, images, turns: int, answers: list[str]) -> str:
    """The prompt of turn `turns` + 1: each earlier turn a user message (an image in the first and
    third) and the assistant's answer, then a new question."""
    messages = []
    for t in range(turns + 1):
        content = [{"type": "image"}] if t in (0, 2) else []
        content.append({"type": "text", "text": f"Question {t}: what is in the picture, and why?"})
        messages.append({"role": "user", "content": content})
        if t < turns:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[t]}]})
    return engine.processor.chat_prompt(messages)


def test_multi_turn_answers_equal_hf_with_the_cache_and_reuse_each_turn(family):
    """Four turns, history resent each time, images in turns 1 and 3: with the cache each turn
    computes little more than what is new, and every answer equals HF's greedy answer on the
    whole conversation and the answer without the cache."""
    path, hf = family
    imgs = [make_image(0, (80, 64)), make_image(1, (64, 96))]
    with engines(path) as build:
        cached, plain = build(), build(prefix_caching=False)
        answers: list[str] = []
        previous = 0
        for turn in range(4):
            prompt = conversation(cached, imgs, turn, answers)
            used = imgs[: (turn >= 0) + (turn >= 2)]
            before = cached.blocks.hit_tokens
            got = cached.generate([prompt], [used], SamplingParams(max_tokens=8))[0]
            want = plain.generate([prompt], [used], SamplingParams(max_tokens=8))[0]
            processed = cached.processor.process(prompt, used)
            assert (
                got.token_ids
                == want.token_ids
                == hf_greedy_ids(hf, processed, cached.processor.image_token_id, 8)
            ), f"turn {turn + 1}"
            hit = cached.blocks.hit_tokens - before
            if turn:  # the previous turn's prompt is found again, all but its last, partial block
                size = cached.config.block_size
                assert hit >= (previous // size - 1) * size, f"turn {turn + 1}: {hit} of {previous} tokens"
            previous = len(processed.token_ids)
            answers.append(got.text or "ok")
        assert plain.blocks.hit_tokens == 0
        cached.check_integrity()
        assert cached.blocks.num_free == cached.blocks.num_blocks  # idle: every block free or cached


def test_shared_blocks_survive_a_cancel_and_a_preemption(make_engine, hf_generate, images):
    """Two requests share a prompt's blocks; one is cancelled mid-way and the other preempted by a
    third that needs the space: counts stay right after every step, and the answers stay exact."""
    per_block = 2 * 4 * 2 * 16 * 16 * 4  # K and V, 4 layers, 2 kv heads, head dim 16, 16 tokens, fp32
    engine = make_engine(kv_cache_bytes=16 * per_block)
    prompt = engine.chat_prompt("Tell me a long story about a small boat that sails at night", 1)
    first = engine.add_request(prompt, images[:1], SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    shared = [engine.add_request(prompt, images[:1], SamplingParams(max_tokens=30)) for _ in range(2)]
    engine.step()
    assert all(r.num_computed_tokens >= len(r.prompt_token_ids) - engine.config.block_size for r in shared)
    tables = [engine.blocks.table(r.request_id) for r in shared]
    assert set(tables[0]) & set(tables[1]), "the prompt's blocks are shared"
    engine.check_integrity()
    engine.abort(shared[0].request_id)
    engine.check_integrity()
    other = engine.add_request(engine.chat_prompt("Count to fifty slowly", 2), images[1:3],
                               SamplingParams(max_tokens=60))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert shared[1].num_preemptions + other.num_preemptions > 0, "the test must preempt"
    assert shared[1].output_token_ids == hf_generate(prompt, images[:1], 30)
    assert other.output_token_ids == hf_generate(
        engine.chat_prompt("Count to fifty slowly", 2), images[1:3], 60
    )
    assert first.output_token_ids == hf_generate(prompt, images[:1], 6)
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("policy", list(Policy))
def test_a_repeated_prompt_reuses_its_prefix_under_every_policy(make_engine, hf_generate, images, policy):
    """One at a time, then three at once: each policy admits a request from its cached prefix (the
    comparison policies admit whole prompts, so they must look it up before sizing them)."""
    engine = make_engine(policy=policy)
    prompt = engine.chat_prompt("What is in the picture? Tell me a long story", 1)
    want = hf_generate(prompt, images[:1], 12)
    for _ in range(2):
        assert engine.generate([prompt], [images[:1]], SamplingParams(max_tokens=12))[0].token_ids == want
    burst = engine.generate([prompt] * 3, [images[:1]] * 3, SamplingParams(max_tokens=12))
    assert [c.token_ids for c in burst] == [want] * 3
    assert (
        engine.blocks.hit_tokens
        >= 4 * (len(engine.processor.process(prompt, images[:1]).token_ids) // 16 - 1) * 16
    )
    assert engine.blocks.queried_tokens == 5 * len(engine.processor.process(prompt, images[:1]).token_ids)


def test_a_prefix_ending_inside_a_block_reuses_the_full_blocks_only(make_engine, hf_tiny):
    engine = make_engine()
    size = engine.config.block_size
    long = engine.chat_prompt("Tell me a long story about a small boat that sails to the island at night")
    engine.generate([long], [[]], SamplingParams(max_tokens=2))
    ids = engine.processor.process(long, []).token_ids
    shorter = ProcessedPrompt(ids[: 2 * size + 5], [], torch.zeros(0, dtype=torch.long))  # 2 blocks + 5
    req = engine.add_request(shorter, params=SamplingParams(max_tokens=4))
    engine.step()
    assert engine.blocks.hit_tokens == 2 * size
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == hf_greedy_ids(hf_tiny[0], shorter, engine.processor.image_token_id, 4)


def test_random_add_step_cancel_keeps_the_engine_consistent(make_engine, images):
    """Requests drawn from a few shared prompts, stepped, cancelled at random, on a KV cache small
    enough to preempt: the engine's integrity check (reference counts included) after every step."""
    per_block = 2 * 4 * 2 * 16 * 16 * 4
    engine = make_engine(kv_cache_bytes=20 * per_block, token_budget=24)
    rng = random.Random(26)
    prompts = [
        engine.chat_prompt(f"Story number {i} about boats and islands, told slowly", i % 2) for i in range(3)
    ]
    live = []
    for _ in range(120):
        roll = rng.random()
        if roll < 0.25 and len(live) < 6:
            i = rng.randrange(3)
            live.append(
                engine.add_request(prompts[i], images[: i % 2], SamplingParams(max_tokens=rng.randint(1, 20)))
            )
        elif roll < 0.35 and live:
            engine.abort(live.pop(rng.randrange(len(live))).request_id)
        engine.step()
        engine.check_integrity()
        live = [r for r in live if r.request_id in engine.requests]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.blocks.hit_tokens > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_kv_imported_for_decode_is_never_found_by_its_tokens_alone(make_engine, images):
    """A decoder does not know which images a prefilled request's placeholders stood for, so the
    blocks it imported are not cached under keys of their tokens alone."""
    prefill = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    decode = make_engine(roles=frozenset({Role.DECODE}))
    prompt = prefill.chat_prompt("What is in the picture?", 1)
    req = prefill.add_request(prompt, images[:1], SamplingParams(max_tokens=20))
    while prefill.has_unfinished():
        prefill.step()
    kv = prefill.handoff.export_kv(req.request_id, 2)
    got = decode.handoff.add_prefilled(
        req.request_id, req.prompt_token_ids, req.output_token_ids, req.params, kv
    )
    while decode.has_unfinished():
        decode.step()
    prefill.abort(req.request_id)
    assert not got.cacheable and decode.blocks.num_cached == 0
    assert prefill.blocks.num_cached > 0


def test_a_requests_cached_tokens_reach_its_final_output(make_engine, images):
    """What usage reports as cached: the first asking finds nothing, the second all its full blocks
    but the one holding its last token; a request prefilled elsewhere carries the prefill's count
    to its decoder's final output."""
    engine = make_engine()
    size = engine.config.block_size
    prompt = engine.chat_prompt("What is in the picture? Tell me everything", 1)
    n = len(engine.processor.process(prompt, images[:1]).token_ids)
    finals = []
    for _ in range(2):
        engine.add_request(prompt, images[:1], SamplingParams(max_tokens=3))
        while engine.has_unfinished():
            finals += [o for o in engine.step() if o.finished]
    assert [o.num_cached_tokens for o in finals] == [0, (n - 1) // size * size]

    prefill = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    decode = make_engine(roles=frozenset({Role.DECODE}))
    req = prefill.add_request(prompt, images[:1], SamplingParams(max_tokens=3))
    while prefill.has_unfinished():
        prefill.step()
    kv = prefill.handoff.export_kv(req.request_id, 2)
    decode.handoff.add_prefilled(
        "d", req.prompt_token_ids, req.output_token_ids, SamplingParams(max_tokens=3), kv, cached_tokens=32
    )
    outs = []
    while decode.has_unfinished():
        outs += decode.step()
    prefill.abort(req.request_id)
    assert [o.num_cached_tokens for o in outs if o.finished] == [32]


def test_a_decoder_keeps_the_conversation_and_the_next_turn_computes_only_what_is_new(
    tiny_model_dir, hf_tiny, images
):
    """Decoder-side reuse (issue 26, point 3): a request whose KV was imported with its images'
    identities keeps its blocks keyed as the prefill instance keyed them, its answer's included, so
    the conversation's next turn prefilled on that decoder computes only what is new, and answers
    as HF does on the whole conversation. The imported request is never a preemption victim."""
    with engines(tiny_model_dir) as build:
        prefill = build(roles=frozenset({Role.ENCODE, Role.PREFILL}))
        decoder = build(roles=frozenset({Role.PREFILL, Role.DECODE}))
        size = decoder.config.block_size
        req = prefill.add_request(
            conversation(prefill, images, 0, []), images[:1], SamplingParams(max_tokens=8)
        )
        while prefill.has_unfinished():
            prefill.step()
        kv = prefill.handoff.export_kv(req.request_id, 2)
        got = decoder.handoff.add_prefilled(
            req.request_id, req.prompt_token_ids, req.output_token_ids, req.params, kv,
            images=req.images, image_positions=req.image_positions,
        )  # fmt: skip
        assert got.cacheable and not got.recomputable and not got.needs_encode
        while decoder.has_unfinished():
            decoder.step()
        prefill.abort(req.request_id)
        prompt_keys = block_hashes(req, len(req.prompt_token_ids) // size, size)
        assert set(prompt_keys) <= set(decoder.blocks.cached_hashes())
        assert decoder.blocks.num_cached >= len(got.all_token_ids) // size  # the answer's blocks too

        answer = decoder.tokenizer.decode(got.output_token_ids, skip_special_tokens=True)
        processed = prefill.processor.process(conversation(prefill, images, 1, [answer or "ok"]), images[:1])
        features = [prefill.features.get(img.content_hash) for img in processed.images]
        assert all(f is not None for f in features)  # the feature store's part, in a deployment
        encoded = [
            ImageInput(img.content_hash, img.num_tokens, features=f)
            for img, f in zip(processed.images, features, strict=True)
        ]
        turn = decoder.add_request(
            ProcessedPrompt(processed.token_ids, encoded, processed.image_positions),
            params=SamplingParams(max_tokens=8),
        )
        while decoder.has_unfinished():
            decoder.step()
            decoder.check_integrity()
        assert turn.num_cached_tokens >= len(prompt_keys) * size
        want = hf_greedy_ids(hf_tiny[0], processed, decoder.processor.image_token_id, 8)
        assert turn.output_token_ids == want
        assert decoder.blocks.num_free == decoder.blocks.num_blocks  # idle: every block free or cached


def test_an_imported_request_is_never_preempted_for_another(make_engine, images):
    """On a decoder that also prefills, a request whose images were encoded elsewhere cannot be
    computed again: it reserves its whole length and another request's growth never evicts it."""
    per_block = 2 * 4 * 2 * 16 * 16 * 4
    prefill = make_engine(roles=frozenset({Role.ENCODE, Role.PREFILL}))
    decoder = make_engine(roles=frozenset({Role.PREFILL, Role.DECODE}), kv_cache_bytes=14 * per_block)
    req = prefill.add_request(
        prefill.chat_prompt("What is in it?", 1), images[:1], SamplingParams(max_tokens=100)
    )
    while prefill.has_unfinished():
        prefill.step()
    kv = prefill.handoff.export_kv(req.request_id, 2)
    imported = decoder.handoff.add_prefilled(
        "imported", req.prompt_token_ids, req.output_token_ids, req.params, kv,
        images=req.images, image_positions=req.image_positions,
    )  # fmt: skip
    prefill.abort(req.request_id)
    reserved = len(decoder.blocks.table(imported.request_id))
    assert reserved * 16 >= len(imported.prompt_token_ids) + 100
    # Its whole length and this one's cannot both fit: this one's growth needs a victim.
    local = decoder.add_request(decoder.chat_prompt("Count slowly", 0), [], SamplingParams(max_tokens=150))
    assert reserved + (len(local.prompt_token_ids) + 150) // 16 + 1 > decoder.blocks.num_blocks
    while decoder.has_unfinished():
        decoder.step()
        decoder.check_integrity()
    assert imported.num_preemptions == 0 and len(imported.output_token_ids) == 100
    assert local.num_preemptions > 0 and len(local.output_token_ids) == 150
