"""Video through the deployed services (issue 29): Qwen2-VL, Qwen2.5-VL and Qwen3-VL deployments
under E+P+D, where the clip's patches cross G→E by handle, its features E→P, and its KV with the
rope delta P→D (Qwen2.5-VL's clip positions need the seconds each temporal patch spans, which
travel in the task; Qwen3-VL's frames are picked its own way and stamped in the prompt). A
`video_url` part (a data: URL of a real H.264 file) answers as HF's model does on the same sampled
frames; every hostile video is a 4xx saying why, and the deployment answers the next request at
once. The hybrids EP+D, ED+P and EPD run a clip in process: tests/stages/test_methods.py."""

from __future__ import annotations

import functools
import time

import httpx
import pytest

from common.engine.processor import RequestProcessor
from common.video import VideoLimits, decode_video
from tests.helpers.chat import client_for
from tests.helpers.deployments import Deployment, shared
from tests.helpers.engine import hf_greedy
from tests.helpers.images import data_url, make_image
from tests.media.clips import declare_duration, make_clip
from trident.bench.clips import video_data_url

pytestmark = pytest.mark.timeout(300)
QUESTION = "What happens in the video?"
# Each family's E+P+D deployment: the same ones test_model_families.py runs its images on.
FAMILIES = {name: Deployment.of(name) for name in ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl")}
family = shared(*FAMILIES.values(), ids=list(FAMILIES))
# The bounds are the gateway's, whatever the model: checked on one deployment.
qwen2 = shared(FAMILIES["tiny-qwen2-vl"])


CLIP = functools.cache(lambda: make_clip(30, fps=10, size=(112, 84), seed=1))


@functools.cache
def reference(model_dir, with_image: bool, max_tokens: int) -> str:
    """HF's greedy answer on the frames the gateway samples by default (2 fps, at most 32)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = RequestProcessor(model_dir)
    content = ([{"type": "image"}] if with_image else []) + [
        {"type": "video"},
        {"type": "text", "text": QUESTION},
    ]
    prompt = processor.chat_prompt([{"role": "user", "content": content}])
    clip = decode_video(CLIP(), VideoLimits(), fps=2.0, max_frames=32, rule=processor.videos.rule)
    images = [make_image(0, (80, 64))] if with_image else []
    processed = processor.process(prompt, images, [clip])
    return processor.tokenizer.decode(
        hf_greedy(model, processed, processor, max_tokens), skip_special_tokens=True
    )


def messages(video: str, with_image: bool = False) -> list[dict]:
    parts = (
        [{"type": "image_url", "image_url": {"url": data_url(make_image(0, (80, 64)))}}] if with_image else []
    )
    parts += [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize(
    ("family", "with_image"),
    [(FAMILIES["tiny-qwen2-vl"], False), (FAMILIES["tiny-qwen2-vl"], True),
     (FAMILIES["tiny-qwen2.5-vl"], False), (FAMILIES["tiny-qwen3-vl"], True)],
    ids=["tiny-qwen2-vl", "tiny-qwen2-vl-with-image", "tiny-qwen2.5-vl", "tiny-qwen3-vl-with-image"],
    indirect=["family"],
)  # fmt: skip
def test_a_clip_answers_as_hf(family, with_image):
    """Under E+P+D. The hybrids (the clip's features kept on an EP or ED instance, or all three
    stages on one): tests/stages/test_methods.py."""
    name = family.model.name
    answer = client_for(family).chat.completions.create(
        model=name, messages=messages(video_data_url(CLIP()), with_image), max_tokens=16, temperature=0
    )
    assert answer.choices[0].message.content == reference(family.model, with_image, 16)
    assert answer.usage.prompt_tokens > 40  # the clip's tokens are in the prompt


HOSTILE = {
    "truncated": (lambda: CLIP()[: len(CLIP()) // 2], 400, "damaged or cut short"),
    "not a video": (lambda: bytes(range(256)) * 8, 400, "not a video"),
    "unknown codec": (lambda: CLIP().replace(b"avc1", b"zzzz"), 400, "codec"),
    "10,000 frames": (lambda: make_clip(10_000, fps=100, size=(16, 16)), 413, "10,000 frames"),
    "8K": (lambda: make_clip(1, size=(7680, 4320)), 413, "7680x4320"),
    "lies about its length": (lambda: declare_duration(make_clip(700, fps=1, size=(16, 16))), 413, "runs"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_clip_is_a_4xx_and_the_next_request_answers(qwen2, name):
    make, status, words = HOSTILE[name]
    body = {"model": "tiny-qwen2-vl", "messages": messages(video_data_url(make())), "max_tokens": 4}
    reply = httpx.post(qwen2.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"] and reply.json()["error"]["param"] == "video_url"
    start = time.monotonic()
    ok = httpx.post(
        qwen2.url + "/v1/chat/completions",
        json={"model": "tiny-qwen2-vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200 and time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("controls", "param"),
    [({"fps": 100.0}, "mm_processor_kwargs.fps"), ({"max_frames": 10_000}, "mm_processor_kwargs.max_frames"),
     ({"num_frames": 4}, "mm_processor_kwargs.num_frames")],
)  # fmt: skip
def test_sampling_controls_within_the_caps(qwen2, controls, param):
    body = {
        "model": "tiny-qwen2-vl", "messages": messages(video_data_url(CLIP())), "max_tokens": 2,
        "mm_processor_kwargs": controls,
    }  # fmt: skip
    reply = httpx.post(qwen2.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    body["mm_processor_kwargs"] = {"fps": 1.0, "max_frames": 4}  # asked within the caps: fewer frames
    fewer = httpx.post(qwen2.url + "/v1/chat/completions", json=body, timeout=60)
    assert fewer.status_code == 200, fewer.text
