"""Every input that changes a block's KV is in its key (common/engine/prefix.py), family by family:
two requests that differ only in such an input share the blocks before it and none from it on, and
the second one's answer is HF's own.

What changes an image's KV, per family: its pixels (its content hash) everywhere; its size, which
makes LLaVA-NeXT's tile grid and token count and Qwen-VL's patch grid; for a Qwen-VL clip also its
timing, which Qwen2.5-VL puts into M-RoPE's temporal positions (`second_per_grid_ts`) and Qwen3-VL
writes into the prompt as time stamps. Qwen2-VL's positions ignore a clip's timing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.checkpoints import write_checkpoint
from common.engine.loader import load_config
from common.engine.prefix import block_hashes
from common.engine.processor import VIDEO_RULES
from common.engine.request import ImageInput, Request
from common.engine.sampling import SamplingParams
from common.video import VideoLimits, decode_video
from tests.helpers.engine import engines, hf_greedy, hf_greedy_ids
from tests.helpers.images import make_image
from tests.media.clips import make_clip

BS = 4
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# Text before the image or clip: the blocks it fills are shared, the ones from the image on are not.
PREAMBLE = "You describe pictures and videos for people who cannot see them. Be exact and short. "


def keys(img: ImageInput, lead: int = 6) -> list[bytes]:
    """The keys of a request of `lead` text tokens, `img`'s placeholders, then text to fill 8 blocks."""
    tokens = list(range(100, 100 + lead)) + [9] * img.num_tokens
    tokens += list(range(200, 200 + 8 * BS - len(tokens)))
    positions = torch.arange(lead, lead + img.num_tokens)
    req = Request("r", tokens, SamplingParams(), [img], image_positions=positions)
    return block_hashes(req, 8, BS)


def test_every_field_of_an_image_that_reaches_the_model_is_in_its_key():
    """Each of ImageInput's fields but its pixels and features (which its content hash stands for)
    changes the keys from the image's first block on, and no earlier one. A field added to
    ImageInput fails here until the key covers it, or it is named as not changing KV."""
    base = ImageInput("cat", 6, grid_thw=(2, 4, 12), image_size=(64, 80), video=True, seconds_per_patch=1.0)
    other = {
        "content_hash": "dog",
        "num_tokens": 7,
        "grid_thw": (2, 12, 4),
        "image_size": (80, 64),
        "video": False,
        "seconds_per_patch": 0.5,
    }
    assert set(other) | {"pixel_values", "features"} == {f.name for f in dataclasses.fields(ImageInput)}
    want = keys(base)
    shared = []
    for name, value in other.items():
        got = keys(dataclasses.replace(base, **{name: value}))
        assert got[0] == want[0], f"{name}: a block before the image changed"
        if set(got[1:]) & set(want[1:]):
            shared.append(name)
    assert not shared, f"images apart only in {shared} share the blocks from the image on"


# -- the engine, against HF ----------------------------------------------------------------------


def prompt(body: str) -> str:
    return f"<|im_start|>user\n{PREAMBLE}{body}Describe it.<|im_end|>\n<|im_start|>assistant\n"


def clips_apart_in_time(model_dir) -> list:
    """One clip's frames as two files: 32 frames at 4 fps (8 s) and at 8 fps (4 s). Both are
    sampled at 2 fps, at most 8 frames: the same 8 frames, 1 and 2 sampled frames a second."""
    rule = VIDEO_RULES[load_config(model_dir).model_type]
    clips = [
        decode_video(make_clip(32, fps=fps, size=(56, 56), seed=5), VideoLimits(), 2.0, 8, rule=rule)
        for fps in (4, 8)
    ]
    assert clips[0].indices == clips[1].indices and clips[0].duration_s == 2 * clips[1].duration_s
    # x264 rounds each file's pixels a little apart: the second keeps its timing, with the first's frames.
    clips[1] = dataclasses.replace(clips[1], frames=clips[0].frames)
    assert clips[0].content_hash == clips[1].content_hash
    return clips


def one_picture_two_sizes(model_dir) -> list:
    picture = make_image(7, (80, 64))
    return [picture, picture.resize((112, 96))]


# family -> (what differs, the two inputs, whether they are clips)
CASES = {
    "tiny-llava": ("image size", one_picture_two_sizes, False),
    "tiny-llava-next": ("image size", one_picture_two_sizes, False),
    "tiny-qwen2-vl": ("image size", one_picture_two_sizes, False),
    "tiny-qwen2.5-vl": ("clip timing", clips_apart_in_time, True),
    "tiny-qwen3-vl": ("clip timing", clips_apart_in_time, True),
}


# The clip-timing case of Qwen2.5-VL (a wrong answer before the key held the timing) runs in the fast tier.
SLOW = {"tiny-llava", "tiny-qwen3-vl"}


@pytest.fixture(
    scope="module", params=[pytest.param(p, marks=[pytest.mark.slow] if p in SLOW else []) for p in CASES]
)
def family(request, tmp_path_factory):
    """(preset, checkpoint, HF model) of one family's tiny preset."""
    from transformers import AutoModelForImageTextToText

    path = write_checkpoint(tmp_path_factory.mktemp("keys") / request.param, request.param, seed=0)
    return request.param, path, AutoModelForImageTextToText.from_pretrained(path).eval()


def hf_answer(hf, processed, processor, max_tokens: int) -> list[int]:
    """HF `generate`'s greedy ids for a prompt our processor made (before the engine takes its pixels)."""
    if processor.hf is None:  # Qwen-VL: pictures and clips
        return hf_greedy(hf, processed, processor, max_tokens)
    return hf_greedy_ids(hf, processed, processor.image_token_id, max_tokens)


def test_inputs_apart_only_in_what_changes_kv_share_no_block_of_it_and_answer_as_hf(family):
    preset, path, hf = family
    what, make, clips = CASES[preset]
    with engines(path) as build:
        engine = build()
        size, processor = engine.config.block_size, engine.processor
        text = prompt(VIDEO if clips else IMAGE)
        if processor.hf is not None:  # LLaVA's template, with the text first (its own puts images first)
            text = f"USER: {PREAMBLE}{processor.image_token}\nDescribe it. ASSISTANT:"
        answers, cached, ids = [], [], []
        for item in make(path):
            processed = processor.process(text, [], [item]) if clips else processor.process(text, [item])
            want = hf_answer(hf, processed, processor, 8)
            ids.append((processed.token_ids, int(processed.image_positions[0])))
            req = engine.add_request(processed, params=SamplingParams(max_tokens=8))
            while engine.has_unfinished():
                engine.step()
            answers.append((req.output_token_ids, want))
            cached.append(req.num_cached_tokens)
        # Where the two requests part: their first placeholder, or an earlier token (Qwen3-VL's stamp).
        (a, first), (b, _) = ids
        apart = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), first)
        before = min(first, apart) // size * size
        assert before >= size, "the text before the image fills a block at least"
        assert answers[1][0] == answers[1][1], f"{preset}: the second answer is not HF's"
        assert cached[1] == before, (
            f"{preset}: requests apart only in {what} share {cached[1]} tokens' KV; only the "
            f"{before} before they part are the same"
        )
