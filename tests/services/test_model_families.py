"""The families whose image cost follows the image's size (Qwen-VL, LLaVA-NeXT) through the
deployed services, against HF's own model: images of different sizes (so of different token
counts) cross E→P as features (with Qwen3-VL's DeepStack features) and P→D as KV with the M-RoPE
rope delta, and the answer is HF `generate`'s, streamed and whole, under E+P+D, where every
hand-off crosses processes. Each family under the hybrids, where some hand-offs stay in memory:
tests/stages/test_methods.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import openai
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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop", "description": "does nothing"}}


def test_tools_are_called_whole_and_streamed_where_the_template_defines_them(deployment):
    """A named tool_choice and `required` are enforced by the grammar: the answer is a call of the
    template's format, read into tool_calls whole and streamed (id and name first, then argument
    fragments). LLaVA-NeXT's template defines no tool calls: a 400 that says so."""
    model, client = deployment.model.name, client_for(deployment)
    messages = user_message([data_url(make_image(0, SIZES[0]))], "What is the weather there?")
    asked = {
        "model": model,
        "messages": messages,
        "tools": [WEATHER, NOOP],
        "max_tokens": 64,
        "temperature": 0,
    }
    if "qwen" not in model:
        with pytest.raises(openai.BadRequestError, match="defines no tool calls"):
            client.chat.completions.create(**asked)
        return
    named = client.chat.completions.create(
        **asked, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    choice = named.choices[0]
    (call,) = choice.message.tool_calls
    assert (choice.finish_reason, call.function.name, choice.message.content) == ("stop", "get_weather", None)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(**asked, tool_choice="required", stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = calls.setdefault(part.index, {"name": part.function.name, "id": part.id, "arguments": ""})
            got["arguments"] += part.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "length")
    assert calls and all(c["id"] and c["name"] in ("get_weather", "noop") for c in calls.values())
    if chunks[-1].choices[0].finish_reason == "tool_calls":
        assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls.values())
    # The call and its result sent back: the template renders both, and the model answers.
    back = [*messages, named.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]  # fmt: skip
    reply = client.chat.completions.create(**{**asked, "messages": back, "tool_choice": "none"})
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in (
        "stop",
        "length",
    )
