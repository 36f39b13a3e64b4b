"""Every model family under every method, in process: the stage handlers of each instance a method
runs (E+P+D: three; EP+D and ED+P: a hybrid and one more; EPD: one) on real engines, NATS, Redis
and TCP transfer, each pulling its tasks through a worker's own intake. Images of two sizes cross
E→P as features (Qwen3-VL's with DeepStack's) and P→D as KV with M-RoPE's rope delta, or stay in
a hybrid's memory; a clip beside an image does the same; every answer is HF `generate`'s, token
for token, and every instance ends holding nothing.

The deployments keep one per method (tests/services/test_e2e.py, on tiny-llava) and one per
family (tests/services/test_model_families.py and test_video_e2e.py, E+P+D): what only processes
can show. The cross-product is here."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint
from common.engine.processor import ProcessedPrompt, RequestProcessor
from common.video import VideoLimits, decode_video
from tests.helpers.engine import hf_greedy, hf_greedy_ids
from tests.helpers.images import make_image
from tests.media.clips import make_clip
from tests.stages.flows import D, E, P, ask, serving
from tests.stages.rig import ServingThread, stage_rig

METHODS = {"e+p+d": (E, P, D), "ep+d": (E | P, D), "ed+p": (E | D, P), "epd": (E | P | D,)}
# LLaVA under each method in the fast tier (the engine tests hand Qwen-VL's rope delta across
# E→P→D there too); every other family in `make test`.
FAMILIES = [
    "tiny-llava",
    pytest.param("tiny-qwen2-vl", marks=pytest.mark.slow),
    pytest.param("tiny-llava-next", marks=pytest.mark.slow),
    pytest.param("tiny-qwen2.5-vl", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3-vl", marks=pytest.mark.slow),
]
SIZES = [(120, 90), (56, 200)]  # different grids (Qwen-VL) and tilings (LLaVA-NeXT): different token counts
QUESTION = "What is in the picture? Describe it"
TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's checkpoint, written once for all the methods it runs under."""
    return functools.cache(
        lambda preset: write_checkpoint(tmp_path_factory.mktemp("family") / preset, preset, seed=0)
    )


@functools.cache
def hf_model(model_dir: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


@functools.cache
def processor_of(model_dir: Path) -> RequestProcessor:
    return RequestProcessor(model_dir)


def chat(processor: RequestProcessor, num_images: int, clip: bool = False) -> ProcessedPrompt:
    """The prompt the gateway would make of a chat with `num_images` images (and a clip)."""
    content = [{"type": "image"}] * num_images + ([{"type": "video"}] if clip else [])
    text = "What happens in the video?" if clip else QUESTION
    prompt = processor.chat_prompt([{"role": "user", "content": [*content, {"type": "text", "text": text}]}])
    images = [make_image(i, size) for i, size in enumerate(SIZES[:num_images])]
    if not clip:
        return processor.process(prompt, images)
    video = make_clip(30, fps=10, size=(112, 84), seed=1)  # sampled as the gateway does by default
    frames = decode_video(video, VideoLimits(), fps=2.0, max_frames=32, rule=processor.videos.rule)
    return processor.process(prompt, images, [frames])


@contextlib.asynccontextmanager
async def instances(method: str, model_dir: Path, nats_server, redis_server):
    """The method's instances as rigs, serving; each checked to hold nothing once the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        rigs = [
            await stack.enter_async_context(stage_rig(roles, model_dir, nats_server, redis_server))
            for roles in METHODS[method]
        ]
        async with serving(*rigs):
            yield rigs
        for rig in rigs:
            await rig.idle()


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
async def test_answers_equal_hf_under_each_method(
    family, method, checkpoints, nats_server, redis_server, owner: ServingThread
):
    """A text request and one with two images of different sizes, side by side."""
    model_dir = checkpoints(family)
    processor = processor_of(model_dir)
    prompts = [chat(processor, n) for n in (0, 2)]
    want = [hf_greedy_ids(hf_model(model_dir), p, processor.image_token_id, TOKENS) for p in prompts]
    async with instances(method, model_dir, nats_server, redis_server) as rigs:
        asks = (ask(rigs[0], owner, p, f"{method}-{n}", TOKENS) for n, p in enumerate(prompts))
        assert await asyncio.gather(*asks) == want


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "family"), [("ep+d", "tiny-qwen3-vl"), ("ed+p", "tiny-qwen2.5-vl"), ("epd", "tiny-qwen2-vl")]
)
async def test_a_clip_beside_an_image_answers_as_hf_under_the_hybrids(
    method, family, checkpoints, nats_server, redis_server, owner: ServingThread
):
    """The clip's features stay on an EP or ED instance, or all three stages run on one (the
    clip's seconds per temporal patch travel in the task: Qwen2.5-VL's positions need them)."""
    model_dir = checkpoints(family)
    processor = processor_of(model_dir)
    processed = chat(processor, 1, clip=True)
    assert any(i.video for i in processed.images)
    want = hf_greedy(hf_model(model_dir), processed, processor, TOKENS)
    async with instances(method, model_dir, nats_server, redis_server) as rigs:
        assert await ask(rigs[0], owner, processed, "clip", TOKENS) == want
