"""The families whose image cost follows the image's size (Qwen-VL, LLaVA-NeXT) through the
deployed services, against HF's own model: images of different sizes (so of different token
counts) cross E→P as features (with Qwen3-VL's DeepStack features) and P→D as KV with the M-RoPE
rope delta, and the answer is HF `generate`'s, streamed and whole, under E+P+D, where every
hand-off crosses processes. Each family under the hybrids, where some hand-offs stay in memory:
tests/stages/test_methods.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from common.engine.processor import RequestProcessor
from tests.helpers.chat import QUESTION, client_for, user_message
from tests.helpers.deployments import Deployment, shared
from tests.helpers.engine import hf_greedy_ids
from tests.helpers.images import data_url, make_image

SIZES = [(120, 90), (56, 200)]
FAMILIES = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-llava-next")
# One E+P+D deployment per family, shared with test_video_e2e.py: every hand-off crosses processes.
# The hybrids (EP+D, ED+P, EPD) of every family run in process: tests/stages/test_methods.py.
deployment = shared(*(Deployment.of(preset) for preset in FAMILIES), ids=list(FAMILIES))


@functools.cache
def hf_model(model_dir: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval(), RequestProcessor(model_dir)


@functools.cache
def hf_answer(model_dir: Path, num_images: int, max_tokens: int) -> tuple[str, int]:
    """HF's greedy answer for the chat: its model on the prompt our processor makes (the
    processor's placeholder rule is checked against the engine tests' positions and parity).
    Computed once per checkpoint, whatever the method."""
    model, processor = hf_model(model_dir)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    prompt = processor.chat_prompt([{"role": "user", "content": content}])
    processed = processor.process(prompt, [make_image(i, s) for i, s in enumerate(SIZES[:num_images])])
    new = hf_greedy_ids(model, processed, processor.image_token_id, max_tokens)
    return processor.tokenizer.decode(new, skip_special_tokens=True), len(new)


@pytest.mark.parametrize("num_images", [0, 2])
def test_answers_match_hf_streaming_and_not(deployment, num_images):
    model, client = deployment.model.name, client_for(deployment)
    urls = [data_url(make_image(i, s)) for i, s in enumerate(SIZES[:num_images])]
    messages = user_message(urls, QUESTION)
    want_text, want_tokens = hf_answer(deployment.model, num_images, 16)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want_text
    assert whole.usage.completion_tokens == want_tokens
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_text
    assert chunks[-1].usage.completion_tokens == want_tokens
