"""Workload shapes, arrival processes and image-token counts."""

import functools
import itertools
import types

import numpy as np
import pytest
from PIL import Image

from common.planner.trace import rate, summary
from common.planner.workloads import (
    SHAPES,
    Discrete,
    LogNormal,
    generate,
    llava15_tokens,
    llava_next_tokens,
    qwen2_vl_clip_tokens,
    qwen2_vl_tokens,
)


def _gaps(entries) -> np.ndarray:
    return np.diff([e.arrival for e in entries])


def test_same_seed_same_trace_other_seed_another():
    a = generate("textcaps", rate=4, num_requests=200, seed=7)
    assert a == generate("textcaps", rate=4, num_requests=200, seed=7)
    assert a != generate("textcaps", rate=4, num_requests=200, seed=8)


def test_requests_do_not_depend_on_the_arrival_process_or_rate():
    """A rate sweep must replay the same requests, only timed differently."""
    sizes = [
        [(e.prompt_tokens, e.image_sizes, e.output_tokens) for e in trace]
        for trace in (
            generate("vizwiz", rate=1, num_requests=300, seed=3),
            generate("vizwiz", rate=9, num_requests=300, seed=3, arrival="gamma"),
        )
    ]
    assert sizes[0] == sizes[1]
    slow, fast = (generate("pope", rate=r, num_requests=50, seed=3) for r in (1, 4))
    assert [e.arrival for e in fast] == pytest.approx([e.arrival / 4 for e in slow])


def test_arrivals_start_at_zero_and_are_sorted():
    for arrival in ("poisson", "gamma"):
        times = [e.arrival for e in generate("mme", rate=5, num_requests=500, arrival=arrival)]
        assert times[0] == 0.0 and times == sorted(times)


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("gamma", 2.0), ("gamma", 0.5)])
def test_long_trace_has_the_target_rate_and_burstiness(arrival, cv):
    entries = generate("textvqa", rate=8, duration=2500, arrival=arrival, cv=cv, seed=1)
    assert entries[-1].arrival < 2500
    assert len(entries) == pytest.approx(8 * 2500, rel=0.05)
    assert rate(entries) == pytest.approx(8, rel=0.05)
    gaps = _gaps(entries)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_a_counted_trace_has_exactly_the_rate(arrival):
    """A short bursty draw can be 10 % off its nominal rate; a counted trace is stretched to it."""
    entries = generate("textvqa", rate=3, num_requests=200, arrival=arrival, cv=3.0, seed=1)
    assert rate(entries) == pytest.approx(3)


def test_replay_keeps_relative_gaps_and_hits_the_rate():
    stamps = [1000.0, 1000.5, 1000.6, 1003.0, 1003.1, 1009.0]
    entries = generate("mme", rate=2, arrival="replay", timestamps=list(reversed(stamps)))
    assert len(entries) == len(stamps) and entries[0].arrival == 0.0
    assert rate(entries) == pytest.approx(2)
    original = np.diff(stamps)
    assert _gaps(entries) / original == pytest.approx(np.full(len(original), _gaps(entries)[0] / original[0]))


def test_replay_takes_a_prefix_or_cuts_at_duration():
    stamps = [0.0, 1.0, 2.0, 10.0, 11.0]
    prefix = generate("mme", rate=1, arrival="replay", timestamps=stamps, num_requests=3)
    assert [e.arrival for e in prefix] == pytest.approx([0, 1, 2])
    # All five rescaled to 1 req/s span 4 s: 0, 0.36, 0.73, 3.64, 4.0; the first 3.5 s keep three.
    cut = generate("mme", rate=1, arrival="replay", timestamps=stamps, duration=3.5)
    assert len(cut) == 3


def test_mix_is_half_text_only():
    entries = generate("mix", rate=5, num_requests=4000, seed=4)
    text_only = [e for e in entries if e.num_images == 0]
    assert len(text_only) / len(entries) == pytest.approx(0.5, abs=0.03)
    assert all(e.image_tokens == 0 and e.image_sizes == () for e in text_only)
    assert {e.image_sizes for e in entries if e.num_images} == {((1280, 720),)}
    assert summary(entries)["text_only"] == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_means_are_the_documented_ones(name):
    """Sampled means stay within 10 % of each shape's stated means (docs/workloads.md's table)."""
    shape = SHAPES[name]
    entries = generate(name, rate=5, num_requests=5000, seed=5, image_tokens=0)
    assert np.mean([e.num_images for e in entries]) == pytest.approx(shape.images.mean, rel=0.1)
    assert np.mean([e.text_tokens for e in entries]) == pytest.approx(shape.text_tokens.mean, rel=0.1)
    assert np.mean([e.output_tokens for e in entries]) == pytest.approx(shape.output_tokens.mean, rel=0.1)
    assert all(e.dataset == name and e.request_id.startswith(name) for e in entries)


def test_sharegpt4o_images_average_002s_resolution():
    sizes = [s for e in generate("sharegpt4o", rate=5, num_requests=20_000) for s in e.image_sizes]
    assert np.mean(sizes, axis=0) == pytest.approx([802, 652], rel=0.03)


def test_mme_asks_for_the_fewest_output_tokens():
    means = {n: summary(generate(n, rate=5, num_requests=2000))["output_tokens"]["mean"] for n in SHAPES}
    assert min(means, key=means.get) == "mme"


def test_image_tokens_as_a_count_or_per_resolution():
    fixed = generate("vizwiz", rate=5, num_requests=50, image_tokens=49)
    assert all(e.image_tokens == 49 * e.num_images for e in fixed)
    assert all(e.image_tokens == 576 for e in generate("vizwiz", rate=5, num_requests=50))
    anyres = generate("vizwiz", rate=5, num_requests=50, image_tokens=llava_next_tokens)
    assert all(e.image_tokens == llava_next_tokens(*e.image_sizes[0]) for e in anyres)
    assert llava15_tokens(4000, 3000) == 576


def test_llava_next_tokens_match_hf_processor():
    """HF's `LlavaNextProcessor` is the oracle; its count needs only the pinpoints and patch size, so
    it runs on a stand-in object instead of a processor with a tokenizer."""
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    ns = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_grid_pinpoints=pinpoints),
        patch_size=14,
        num_additional_image_tokens=1,
    )
    ns._get_unpadded_features = functools.partial(LlavaNextProcessor._get_unpadded_features, ns)
    for w, h in itertools.chain(itertools.product(range(20, 3000, 97), range(20, 3000, 89)), [(336, 336)]):
        # "default" feature selection drops the CLS feature: the processor subtracts 1.
        expected = LlavaNextProcessor._get_number_of_features(ns, h, w, 336, 336) - 1
        assert llava_next_tokens(w, h) == expected, (w, h)
    assert llava_next_tokens(1024, 768) == 2340
    assert llava_next_tokens(672, 672) == 2928


def test_context_limits_clip_text_and_output():
    entries = generate("mix", rate=5, num_requests=500, max_prompt_tokens=600, max_output_tokens=16)
    assert max(e.prompt_tokens for e in entries) <= 600
    assert max(e.output_tokens for e in entries) == 16
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        generate("textcaps", rate=5, num_requests=5, image_tokens=llava_next_tokens, max_prompt_tokens=2048)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shape": "coco"}, "known: textcaps, pope, mme, textvqa, vizwiz, sharegpt4o, mix"),
        ({"rate": 0}, "rate must be > 0"),
        ({"duration": 10}, "not both"),
        ({"num_requests": None}, "give num_requests or duration"),
        ({"num_requests": 0}, "num_requests must be >= 1"),
        ({"arrival": "uniform"}, "unknown arrival"),
        ({"arrival": "gamma", "cv": 0}, "cv must be > 0"),
        ({"timestamps": [0, 1]}, "timestamps go with arrival='replay'"),
        ({"arrival": "replay"}, "timestamps go with arrival='replay'"),
        ({"arrival": "replay", "timestamps": [0, 1]}, "only 2 timestamps"),
        ({"arrival": "replay", "timestamps": [3, 3], "num_requests": None}, "same instant"),
        ({"image_tokens": -1}, "image_tokens must be >= 0"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    args = {"shape": "pope", "rate": 1.0, "num_requests": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        generate(args.pop("shape"), **args)


def test_distributions_are_data():
    rng = np.random.default_rng(0)
    assert Discrete((2, 4), (1, 3)).mean == 3.5
    assert set(Discrete(("a", "b")).sample(rng, 100)) == {"a", "b"}
    draws = LogNormal(40, 0.5, 10, 60).sample(rng, 1000)
    assert min(draws) >= 10 and max(draws) <= 60
    with pytest.raises(ValueError):
        Discrete((1, 2), (1.0,))


def test_qwen2_vl_tokens_match_the_image_processor():
    """HF's Qwen2-VL image processor is the oracle: its grid (at a release's default pixel bounds)
    over the merge size squared is the image's token count."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil()
    for w, h in itertools.chain(itertools.product(range(20, 3000, 397), range(20, 3000, 389)), [(28, 28)]):
        grid = processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"][0]
        assert qwen2_vl_tokens(w, h) == int(grid.prod()) // 4, (w, h)
    assert qwen2_vl_tokens(1024, 768) == 999  # the figure the function's docstring gives


def test_video_mix_sends_a_clip_with_a_third_of_its_requests():
    entries = generate("video-mix", rate=5, num_requests=3000, seed=6)
    with_clip = [e for e in entries if e.num_videos]
    assert len(with_clip) / len(entries) == pytest.approx(1 / 3, abs=0.03)
    assert all(e.num_videos == 1 and len(e.clips) == 1 for e in with_clip)
    assert all(e.video_tokens == qwen2_vl_clip_tokens(*e.clips[0]) for e in with_clip)
    assert all(e.prompt_tokens == e.text_tokens + e.image_tokens + e.video_tokens for e in entries)
    both = sum(1 for e in with_clip if e.num_images) / len(entries)
    assert both == pytest.approx(1 / 6, abs=0.03)  # clips and images drawn apart
    s = summary(entries)
    assert s["videos_per_request"] == pytest.approx(1 / 3, abs=0.03)
    assert s["text_only"] == pytest.approx(1 / 3, abs=0.03)
    # A shape without clips draws the same requests it drew before clips existed.
    assert all(e.num_videos == 0 and e.clips == () for e in generate("mix", rate=5, num_requests=50, seed=6))


def test_qwen2_vl_clip_tokens_match_the_video_path():
    """The count the workload gives a clip is what the server's own decoding, sampling and video
    patching (common/video.py, common/engine/video_input.py at a release's video bounds) make of a
    real file of that length and size."""
    from common.engine.video_input import VideoPatching
    from common.video import VideoLimits, decode_video
    from trident.bench.clips import clip_bytes

    patching = VideoPatching(
        min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, patch=14, temporal=2, merge=2,
        mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), rescale=1 / 255,
    )  # fmt: skip
    for seconds, width, height in [(1.0, 320, 180), (3.0, 640, 360), (20.0, 160, 96)]:
        clip = decode_video(clip_bytes(seconds, (width, height), seed=0), VideoLimits(), 2.0, 32)
        made = patching(clip.frames, clip.content_hash, clip.sample_fps)
        assert made.num_tokens == qwen2_vl_clip_tokens(seconds, width, height), (seconds, width, height)
