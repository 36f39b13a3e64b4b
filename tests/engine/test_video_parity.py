"""Video through the engine for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: greedy output token-identical
to HF's own `generate` for one clip, two clips, and a clip beside an image, and through the
E→P→D hand-off.

HF's reference inputs are built the way transformers' video processors build them
(common/engine/video_input.py: they need torchvision, which this CPU build of torch lacks):
`pixel_values_videos` and `video_grid_thw` from the clip's frames as decoded and sampled by
common/video.py from a real H.264 file, `mm_token_type_ids` 2 on the video's pad tokens (1 on an
image's), and for Qwen2.5-VL `second_per_grid_ts` = temporal patch / sampled fps, as its processor
sets it. The same inputs reach both models; what is compared is everything after them:
placeholders, the tower on temporal patches, M-RoPE's time positions, splicing and decoding.
For Qwen3-VL the inputs themselves are checked against transformers' own code where it runs
without torchvision (`test_qwen3_clips_as_transformers_makes_them`): the frames it samples, its
resize rule, its normalising and patch order, and the time stamps its processor writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from common.checkpoints import write_checkpoint
from common.engine.loader import load_config
from common.engine.processor import VIDEO_RULES, RequestProcessor
from common.engine.sampling import SamplingParams
from common.roles import Role
from common.video import VideoLimits, decode_video
from tests.helpers.engine import engines, hf_greedy
from tests.helpers.images import make_image
from tests.media.clips import make_clip

PRESETS = [
    "tiny-qwen2-vl",
    pytest.param("tiny-qwen2.5-vl", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3-vl", marks=pytest.mark.slow),
]
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=PRESETS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("video") / request.param, request.param, seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def clips(model_dir):
    """Two clips of different lengths, sizes and rates, decoded and sampled at 2 fps as the
    family samples them."""
    rule = VIDEO_RULES[load_config(model_dir).model_type]
    return [
        decode_video(make_clip(n, fps=fps, size=size, seed=seed), VideoLimits(), 2.0, 8, rule=rule)
        for n, fps, size, seed in [(30, 10, (112, 84), 1), (24, 6, (96, 96), 2)]
    ]


@pytest.fixture
def make_engine(model_dir):
    with engines(model_dir) as build:
        yield build


def prompt(body: str) -> str:
    return f"<|im_start|>user\n{body}Describe what happens.<|im_end|>\n<|im_start|>assistant\n"


CASES = {
    "one clip": (VIDEO, [], [0]),
    "two clips": (VIDEO + "then " + VIDEO, [], [0, 1]),
    "clip and image": (IMAGE + "and " + VIDEO, [0], [1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_video_answers_as_hf(make_engine, hf_model, clips, case):
    body, image_ids, clip_ids = CASES[case]
    engine = make_engine()
    processed = engine.processor.process(
        prompt(body), [make_image(i, (80, 64)) for i in image_ids], [clips[i] for i in clip_ids]
    )
    videos = [i for i in processed.images if i.video]
    assert len(videos) == len(clip_ids) and all(v.grid_thw[0] >= 2 for v in videos)  # several patches in time
    want = hf_greedy(hf_model, processed, engine.processor, 16)
    req = engine.add_request(processed, params=SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == want


def test_video_positions_step_in_time(make_engine, clips):
    """A clip's temporal patches take successive temporal positions (Qwen2.5-VL: tokens_per_second
    × the seconds each spans apart) while its rows and columns repeat; the text after it resumes
    past its rows and columns."""
    engine = make_engine()
    if engine.model.stamped_clips:
        pytest.skip(
            "Qwen3-VL writes a clip's times in its text (test_qwen3_clips_as_transformers_makes_them)"
        )
    processed = engine.processor.process(prompt(VIDEO), [], [clips[0]])
    (video,) = processed.images
    t, h, w = video.grid_thw
    per_patch = h * w // 4
    positions, _ = engine.model.positions(processed.token_ids, processed.images)
    start = int(processed.image_positions[0])
    times = positions[0, start : start + t * per_patch : per_patch] - positions[0, start]
    step = engine.model._interval(video)
    assert times.tolist() == [int(k * step) for k in range(t)]
    assert step == (1.0 if engine.model.tokens_per_second is None else 2 * 2 / clips[0].sample_fps)
    assert (
        positions[1:, start : start + per_patch] == positions[1:, start + per_patch : start + 2 * per_patch]
    ).all()


def test_a_video_crosses_the_hand_off(make_engine, hf_model, clips):
    """E, P and D as three engines, as the services run them: the clip's features, the KV and the
    rope delta (a clip's time positions make it differ from an image's) move between them."""
    enc, pre, dec = (make_engine(roles=frozenset({r})) for r in (Role.ENCODE, Role.PREFILL, Role.DECODE))
    text = prompt(IMAGE + "and " + VIDEO)
    picture = [make_image(3, (80, 64))]
    processed = enc.processor.process(text, picture, [clips[1]])
    want = hf_greedy(hf_model, processed, enc.processor, 12)
    req = enc.add_request(processed, params=SamplingParams(max_tokens=12), request_id="v1")
    outs = []
    while enc.has_unfinished():
        outs += enc.step()
    assert [o.next_stage for o in outs] == [Role.PREFILL]
    again = pre.processor.process(text, picture, [clips[1]])
    for item, done in zip(again.images, req.images, strict=True):
        assert item.content_hash == done.content_hash and done.features is not None
        item.features, item.pixel_values = done.features, None
    preq = pre.add_request(again, params=SamplingParams(max_tokens=12), request_id="v1")
    while pre.has_unfinished():
        pre.step()
    kv = pre.handoff.export_kv("v1", group_size=2)
    dreq = dec.handoff.add_prefilled(
        "v1", preq.prompt_token_ids, preq.output_token_ids, preq.params, kv, rope_delta=preq.rope_delta
    )
    pre.abort("v1")
    while dec.has_unfinished():
        dec.step()
    assert dreq.output_token_ids == want


def test_qwen3_clips_as_transformers_makes_them(tmp_path):
    """Qwen3-VL's video inputs from transformers' own code, where it runs without torchvision:
    `Qwen3VLVideoProcessor`'s frame picks, size rule and patch order (the resize PIL's bicubic
    and the normalising plain torch, as ours: transformers' need torchvision), and
    `Qwen3VLProcessor.replace_video_token`'s stamped text."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    model_dir = write_checkpoint(tmp_path / "q3", "tiny-qwen3-vl", seed=0)
    processor = RequestProcessor(model_dir)
    hf = Qwen3VLVideoProcessor.from_pretrained(model_dir)
    hf.max_frames = 7  # an odd count: the last frame is repeated to fill the last temporal patch
    clip = decode_video(make_clip(40, fps=10, size=(112, 84), seed=1), VideoLimits(), 2.0, 7, rule="qwen3")
    metadata = VideoMetadata(total_num_frames=clip.source_frames, fps=clip.source_fps)
    assert clip.indices == hf.sample_frames(metadata).tolist() and len(clip.indices) == 7

    processed = processor.process(prompt(VIDEO), [], [clip])
    (video,) = processed.images
    factor = hf.patch_size * hf.merge_size
    h, w = smart_resize(
        7, 84, 112, temporal_factor=hf.temporal_patch_size, factor=factor,
        min_pixels=hf.size.shortest_edge, max_pixels=hf.size.longest_edge,
    )  # fmt: skip
    frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in clip.frames])
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(0).float()
    mean, std = (torch.tensor(v).view(1, 1, 3, 1, 1) for v in (hf.image_mean, hf.image_std))
    pixels = (pixels * hf.rescale_factor - mean) / std  # rescale_and_normalize: torchvision's
    patches, t, gh, gw = hf.patchify(pixels, hf.patch_size, hf.merge_size, hf.temporal_patch_size)
    assert video.grid_thw == (t, gh, gw) == (4, h // 16, w // 16)
    torch.testing.assert_close(video.pixel_values, patches[0])

    hf_processor = SimpleNamespace(
        video_processor=hf, video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
    )  # fmt: skip
    metadata.frames_indices = np.asarray(clip.indices)
    inputs = {"video_grid_thw": torch.as_tensor([video.grid_thw]), "video_metadata": [metadata]}
    stamped = Qwen3VLProcessor.replace_video_token(hf_processor, inputs, 0)
    # Frames 0 and 6 at 10 fps make the first patch, the last frame (39) twice the fourth.
    assert stamped.startswith("<0.3 seconds>") and "<3.9 seconds>" in stamped
    want = processor.tokenizer(prompt(VIDEO).replace("<|video_pad|>", stamped))["input_ids"]
    assert processed.token_ids == want
