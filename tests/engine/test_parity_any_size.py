"""The families whose image cost follows the image's size — LLaVA-NeXT's any-resolution tiles and
the Qwen-VL family's native resolution (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): greedy output
token-identical to HF's own `*ForConditionalGeneration.generate` on each tiny preset — text only,
images of different sizes (so of different token counts), batched, chunked through an image, a
feature-cache hit, preemption and the E→P→D hand-off, where the M-RoPE position state (the rope
delta) and Qwen3-VL's DeepStack features have to travel with the request."""

from __future__ import annotations

import pytest

from common.checkpoints import write_checkpoint
from common.engine.models.qwen_vl import mrope_positions
from common.engine.processor import REFERENCE_IMAGE
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import check_mixed_batch, engines, hf_greedy_ids
from tests.helpers.images import make_image

QUESTIONS = [
    "What is in the picture?",
    "Tell me a long story about a small boat that sails to the island at night",
    "Hi",
    "Count the apples and the pears on the table, then say which fruit there is more of",
]
SIZES = [(80, 64), (120, 90), (56, 200), (64, 64)]  # different grids, so different token counts


# LLaVA-NeXT's tiles and Qwen2-VL's M-RoPE grids in the fast tier; Qwen2.5-VL (window attention in
# the vision tower) and Qwen3-VL (DeepStack), which take two thirds of this module's time, in `make
# test` only.
PRESETS = [
    "tiny-llava-next",
    "tiny-qwen2-vl",
    pytest.param("tiny-qwen2.5-vl", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3-vl", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=PRESETS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen") / request.param, request.param, seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def sized_images():
    return [make_image(i, size) for i, size in enumerate(SIZES)]


@pytest.fixture
def make_engine(model_dir):
    with engines(model_dir) as build:
        yield build


@pytest.fixture
def hf_generate(hf_model, make_engine):
    """HF's greedy generate on the same prompt: ids expanded by the processor's rule, the image
    processor's pixels (Qwen-VL: with grids and the token types M-RoPE needs; LLaVA-NeXT: tiles and
    image sizes)."""
    processor = make_engine(roles=frozenset({Role.ENCODE})).processor

    def run(prompt: str, imgs, max_tokens: int) -> list[int]:
        processed = processor.process(prompt, imgs)
        return hf_greedy_ids(hf_model, processed, processor.image_token_id, max_tokens)

    return run


def check(engine, hf_generate, prompt, imgs, max_tokens):
    got = engine.generate([prompt], [imgs], SamplingParams(max_tokens=max_tokens))[0]
    assert got.token_ids == hf_generate(prompt, imgs, max_tokens)
    return got


def test_positions_follow_the_grid_and_text_resumes_past_it():
    """Text, a 1×4×6 grid merged 2×2 (2×3 tokens), text: the image's tokens take (0, row, col)
    offset by where it starts, and the text after it starts at one past its largest coordinate."""
    ids = [1, 2, 9, 9, 9, 9, 9, 9, 3]
    pos, delta = mrope_positions(ids, 9, [(1, 4, 6)], merge=2)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8].tolist() == [5, 5, 5]
    assert delta == 6 - len(ids)
    with pytest.raises(ValueError, match="needs 6 placeholders"):
        mrope_positions(ids[:-2], 9, [(1, 4, 6)], merge=2)


def test_image_token_counts_follow_the_image_size(make_engine, sized_images):
    processor = make_engine(roles=frozenset({Role.ENCODE})).processor
    counts = [processor.process(processor.image_token, [img]).images[0].num_tokens for img in sized_images]
    assert len(set(counts)) >= 2, counts  # LLaVA-NeXT: by size and aspect; Qwen-VL: by area


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_single_request(make_engine, hf_generate, sized_images, num_images):
    engine = make_engine()
    prompt = engine.chat_prompt(QUESTIONS[0], num_images)
    check(engine, hf_generate, prompt, sized_images[1 : 1 + num_images], 24)


def test_eight_mixed_requests_batched(make_engine, hf_generate, sized_images):
    """Different prompt lengths, image counts and sizes and max_tokens, all in flight at once."""
    check_mixed_batch(make_engine(), hf_generate, QUESTIONS, sized_images, stride=3)


def test_decode_steps_padded_to_graph_buckets_keep_parity(make_engine, hf_generate, sized_images):
    """As CUDA graphs run decode steps (padded batch and context, uncaptured here); M-RoPE positions
    ride in the [3, batch] buffer."""
    engine = make_engine(decode_graphs="eager")
    check_mixed_batch(engine, hf_generate, QUESTIONS, sized_images, stride=3)
    assert engine.runner.graphs.runs > 0


def test_chunked_prefill_splits_inside_an_image(make_engine, hf_generate, sized_images):
    """Chunks of 5 tokens start and end inside both images, whose M-RoPE positions are 3-D."""
    engine = make_engine(token_budget=5)
    prompt = engine.chat_prompt(QUESTIONS[3], 2)
    req = engine.add_request(prompt, sized_images[1:3], SamplingParams(max_tokens=16))
    assert all(img.num_tokens > 5 for img in req.images)
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == hf_generate(prompt, sized_images[1:3], 16)


def test_feature_cache_hit_skips_the_encoder(make_engine, hf_generate, sized_images):
    engine = make_engine()
    check(engine, hf_generate, engine.chat_prompt(QUESTIONS[0], 1), sized_images[1:2], 8)
    misses = engine.features.misses
    prompt = engine.chat_prompt(QUESTIONS[1], 1)
    req = engine.add_request(prompt, sized_images[1:2], SamplingParams(max_tokens=8))
    assert not req.needs_encode and engine.features.misses == misses
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == hf_generate(prompt, sized_images[1:2], 8)


def test_preemption_by_recompute_keeps_outputs_exact(make_engine, hf_generate, sized_images):
    """A KV cache with room for the longest request and a little more forces preemption."""
    probe = make_engine(roles=frozenset({Role.ENCODE}))
    prompts = [probe.chat_prompt(QUESTIONS[i], 1 if i % 2 else 0) for i in range(4)]
    imgs = [sized_images[:1] if i % 2 else [] for i in range(4)]
    longest = max(len(probe.processor.process(p, im).token_ids) for p, im in zip(prompts, imgs, strict=True))
    blocks = -(-(longest + 40) // 16) + 2
    engine = make_engine(kv_cache_bytes=blocks * probe.kv_spec.bytes_per_block)
    assert engine.blocks.num_blocks == blocks
    reqs = [
        engine.add_request(p, im, SamplingParams(max_tokens=40)) for p, im in zip(prompts, imgs, strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must actually preempt"
    for req, p, im in zip(reqs, prompts, imgs, strict=True):
        assert req.output_token_ids == hf_generate(p, im, 40)


def test_disaggregated_e_p_d_hand_offs(make_engine, hf_generate, sized_images):
    """E, P and D as three engines: features, KV and the rope delta move between them."""
    enc, pre, dec = (make_engine(roles=frozenset({r})) for r in (Role.ENCODE, Role.PREFILL, Role.DECODE))
    prompt = enc.chat_prompt(QUESTIONS[1], 2)
    req = enc.add_request(prompt, sized_images[1:3], SamplingParams(max_tokens=20), request_id="r1")
    outs = []
    while enc.has_unfinished():
        outs += enc.step()
    assert [o.next_stage for o in outs] == [Role.PREFILL]
    processed = pre.processor.process(prompt, sized_images[1:3])
    for img, done in zip(processed.images, req.images, strict=True):
        img.features, img.pixel_values = done.features, None
    preq = pre.add_request(processed, params=SamplingParams(max_tokens=20), request_id="r1")
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    assert outs[-1].next_stage == Role.DECODE and len(preq.output_token_ids) == 1
    assert (preq.rope_delta < 0) == pre.model.mrope  # M-RoPE: images take fewer positions than tokens
    kv = pre.handoff.export_kv("r1", group_size=2)
    dreq = dec.handoff.add_prefilled(
        "r1", preq.prompt_token_ids, preq.output_token_ids, preq.params, kv, rope_delta=preq.rope_delta
    )
    pre.abort("r1")
    while dec.has_unfinished():
        dec.step()
    assert dreq.output_token_ids == hf_generate(prompt, sized_images[1:3], 20)


def test_a_request_resumed_from_its_streamed_tokens_ends_as_if_never_interrupted(
    make_engine, hf_generate, sized_images
):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = make_engine().chat_prompt(QUESTIONS[1], 1)
    (whole,) = make_engine().generate([prompt], [sized_images[:1]], params)
    engine = make_engine()
    req = engine.add_request(prompt, sized_images[:1], params, output_token_ids=whole.token_ids[:9])
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == whole.token_ids


def test_features_carry_what_the_llm_needs(make_engine, hf_model, sized_images):
    """One tensor per image, of its token count; Qwen3-VL's holds DeepStack's features beside it."""
    engine = make_engine(roles=frozenset({Role.ENCODE}))
    req = engine.add_request(
        engine.chat_prompt(QUESTIONS[0], 1), sized_images[1:2], SamplingParams(max_tokens=1)
    )
    while engine.has_unfinished():
        engine.step()
    (img,) = req.images
    hidden = hf_model.config.text_config.hidden_size
    deep = len(getattr(hf_model.config.vision_config, "deepstack_visual_indexes", None) or [])
    assert img.features.shape == (img.num_tokens, hidden * (1 + deep))
    engine.abort(req.request_id)


def test_the_image_budget_counts_what_an_image_costs(make_engine, sized_images):
    """τe counts image tokens in units of the reference image's (its encode cost is what the
    profile measured): images that together fit one unit share an iteration, larger ones do not,
    and one larger than all of τe still runs, first in an iteration of its own encodes."""
    engine = make_engine(roles=frozenset({Role.ENCODE}), image_budget=1)
    unit = engine.scheduler.image_unit
    small = make_image(10, (56, 56))  # the fewest tokens a picture gets
    large = make_image(8, REFERENCE_IMAGE)  # as the reference: one unit

    def encoded_per_step(images) -> list[list[int]]:
        for i, img in enumerate(images):
            engine.add_request(
                engine.chat_prompt("Hi", 1), [img], SamplingParams(max_tokens=1), f"r{i}-{id(images)}"
            )
        steps = []
        for _ in range(2 * len(images)):  # bounded: a request the budget never lets in fails the test
            if not engine.has_unfinished():
                break
            batch = engine.scheduler.schedule()
            steps.append([r.images[i].num_tokens for r, idx in batch.encodes for i in idx])
            engine.runner.run(batch)
            for r in [r for r, _ in batch.encodes]:
                engine.requests.pop(r.request_id)
                engine.scheduler.remove(r)
        return steps

    small_steps = encoded_per_step([small] * 4)
    assert len(small_steps[0]) == min(4, unit // small_steps[0][0]) > 1
    large_steps = encoded_per_step([large] * 2)
    assert large_steps == [[unit], [unit]]  # two would exceed τe
    engine.scheduler.image_unit = large_steps[0][0] * 2 // 3  # now one image alone exceeds all of τe
    other = make_image(9, large.size)  # not in the feature cache yet
    assert encoded_per_step([other] * 2) == large_steps
