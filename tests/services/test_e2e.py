"""The deployed system against HF `generate`, under each of E+P+D, EP+D, ED+P and EPD."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_image
from tests.services.conftest import client_for

QUESTION = "What is in the picture? Describe it"


def user_message(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def reference(hf_tiny, num_images: int, max_tokens: int) -> tuple[str, int]:
    """HF's greedy answer (text and token count) for the same chat."""
    model, processor = hf_tiny
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [make_image(i) for i in range(num_images)] or None
    enc = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    ids = out[0, enc["input_ids"].shape[1] :].tolist()
    eos = model.config.text_config.eos_token_id
    ids = ids[: ids.index(eos) + 1] if eos in ids else ids
    return processor.tokenizer.decode(ids, skip_special_tokens=True), len(ids)


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_answers_match_hf_streaming_and_not(cluster, hf_tiny, image_urls, num_images):
    client = client_for(cluster)
    messages = user_message(image_urls[:num_images], QUESTION)
    want_text, want_tokens = reference(hf_tiny, num_images, 16)
    whole = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=16, temperature=0
    )
    assert whole.choices[0].message.content == want_text
    assert whole.usage.completion_tokens == want_tokens
    assert whole.usage.prompt_tokens > 0 and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want_text
    assert chunks[-1].usage.completion_tokens == want_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_endpoint_with_text_and_token_ids(cluster):
    client = client_for(cluster)
    text = client.completions.create(
        model="tiny-llava", prompt="USER: hi ASSISTANT:", max_tokens=6, temperature=0
    )
    assert text.usage.completion_tokens == 6 and text.choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny-llava", prompt=[[1, 50, 60, 70]], max_tokens=4, temperature=0)
    assert ids.usage.completion_tokens == 4
