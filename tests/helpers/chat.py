"""Requests as a client sends them to a deployment, HF's answer to the same chat on tiny-llava (the
oracle), and the OpenAI error shape every refusal must have."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import torch

from tests.helpers.images import make_image

QUESTION = "What is in the picture? Describe it"


def user_message(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)


_UNSTRUCK: dict[tuple[int, str], str] = {}


def unstruck(cluster, **ask) -> str:
    """The text `cluster` answers to the (seeded or greedy) request `ask` with nothing struck:
    asked once per deployment and request, the oracle every fault test that sends it compares to."""
    key = (id(cluster), json.dumps(ask, sort_keys=True))
    if key not in _UNSTRUCK:
        _UNSTRUCK[key] = client_for(cluster).chat.completions.create(**ask).choices[0].message.content
    return _UNSTRUCK[key]


def body(**over) -> dict:
    """A small chat request's body (four tokens of "hi"), with `over` in place of its fields."""
    b = {"model": "tiny-llava", "messages": user_message([], "hi"), "max_tokens": 4}
    b.update(over)
    return b


def openai_error(resp: httpx.Response, status: int) -> dict:
    """The response's error object, checked to be OpenAI's shape under `status`."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@functools.cache  # the same for every method and module: hf_tiny is the session's
def reference(hf_tiny, num_images: int, max_tokens: int) -> tuple[str, int]:
    """HF's greedy answer (text and token count) to QUESTION with `num_images` test images."""
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


# A long shared first message: its prompt fills several KV blocks that a later turn or question finds
# cached (routing by prefix, a decoder continuing a conversation).
PREAMBLE = "You answer questions about foxes. " + "The quick brown fox jumps over the lazy dog. " * 24
