"""OpenAI request validation: what is accepted, and what is refused with a message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.errors import explain
from services.gateway.api_models import ChatCompletionRequest, CompletionRequest


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return ChatCompletionRequest.model_validate(body)


def test_images_become_template_parts_in_order():
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:a"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": "data:b"}},
                ],
            },
        ]
    )
    messages, urls = req.template_messages()
    assert urls == ["data:a", "data:b"]
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "be brief"}]}


def test_sampling_params_and_max_completion_tokens_precedence():
    req = chat(max_tokens=5, max_completion_tokens=7, temperature=0, stop="END", seed=3, ignore_eos=True)
    p = req.sampling_params(default_max_tokens=100)
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.ignore_eos) == (7, 0, ("END",), 3, True)
    assert chat().sampling_params(100).max_tokens == 100


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": 33}, "less than or equal to 32"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"messages": []}, "at least 1"),
        ({"temperature": 3}, "less than or equal to 2"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"presence_penalty": 2.5}, "less than or equal to 2"),
        ({"repetition_penalty": 0}, "greater than 0"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "does not match"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(change, message):
    with pytest.raises(ValidationError, match=message):
        chat(**change)


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompt == [5, 6]
    with pytest.raises(ValidationError, match="one prompt"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})


def test_what_vllm_bench_serve_sends_validates():
    """`vllm bench serve --backend openai` sends vLLM's `repetition_penalty: 1.0` and `logprobs: null`."""
    body = {"model": "m", "prompt": "hi", "repetition_penalty": 1.0, "logprobs": None, "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    req = CompletionRequest.model_validate(body)
    assert req.include_usage and req.sampling_params(100).ignore_eos
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    assert chat(**chat_body).sampling_params(100).max_tokens == 9


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"logit_bias": {"15": 101}}, "logit_bias"),
        ({"logit_bias": {"token": 1}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"best_of": 3}, "best_of"),
        ({"top_logprobs": 1}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"user": "\ud800"}, "user"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]},
            "messages.0.content.0.text",
        ),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_naming_the_field(change, param):
    with pytest.raises(ValidationError) as caught:
        chat(**change)
    assert explain(caught.value.errors()).param == param


def test_neutral_values_of_unhonoured_fields_are_accepted_and_stop_token_ids_reach_the_engine():
    neutral = {"logit_bias": None, "min_p": 0, "min_tokens": 0, "best_of": 1, "top_logprobs": None,
               "use_beam_search": False, "length_penalty": 1.0, "response_format": {"type": "text"},
               "tools": [], "logprobs": False}  # fmt: skip
    assert chat(**neutral).sampling_params(10).max_tokens == 10
    assert chat(logit_bias={}).sampling_params(10).max_tokens == 10
    assert chat(stop_token_ids=[7, 9]).sampling_params(10).stop_token_ids == (7, 9)


def test_a_validation_error_says_where_and_why():
    null_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": None}}]}]
    with pytest.raises(ValidationError) as caught:
        chat(messages=null_url)
    error = explain(caught.value.errors())
    assert error.param == "messages.0.content.0.image_url.url"
    assert error.message == "messages.0.content.0.image_url.url: is null; it must be a string"
    bad_json = [
        {
            "type": "json_invalid",
            "loc": ("body", 13),
            "msg": "JSON decode error",
            "ctx": {"error": "Expecting value"},
        }
    ]
    error = explain(bad_json, '{\n  "a": 1,\n x')
    assert error.param is None
    assert error.message == "request body is not valid JSON: Expecting value at line 3, column 2 (char 13)"


def test_video_parts_and_their_sampling_controls():
    req = chat(
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:v1"}},
            {"type": "image_url", "image_url": {"url": "data:a"}},
            {"type": "video_url", "video_url": {"url": "https://x/v2.mp4"}},
        ]}],
        mm_processor_kwargs={"fps": 1.5, "max_frames": 16},
    )  # fmt: skip
    messages, urls = req.template_messages()
    assert messages[0]["content"] == [{"type": "video"}, {"type": "image"}, {"type": "video"}]
    assert urls == ["data:a"] and req.video_urls() == ["data:v1", "https://x/v2.mp4"]
    assert (req.mm_processor_kwargs.fps, req.mm_processor_kwargs.max_frames) == (1.5, 16)
    for bad in ({"fps": 0}, {"max_frames": 1}, {"num_frames": 8}, {"fps": float("nan")}):
        with pytest.raises(ValidationError):
            chat(messages=[{"role": "user", "content": "hi"}], mm_processor_kwargs=bad)


def integer_fields(model) -> list[str]:
    """Every top-level field of `model` whose JSON schema takes an integer."""
    fields = []
    for name, prop in model.model_json_schema()["properties"].items():
        kinds = [p.get("type") for p in prop.get("anyOf", [prop])]
        if "integer" in kinds:
            fields.append(name)
    return fields


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=["chat", "completions"])
def test_every_integer_field_refuses_a_string_a_decimal_and_a_boolean_as_the_openai_api_does(model):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    fields = integer_fields(model)
    assert {"max_tokens", "n", "seed", "top_k"} <= set(fields)
    for name in fields:
        takes_bool = "boolean" in str(model.model_json_schema()["properties"][name])
        for value, said in [
            ("12", "a string"),
            (12.0, "a decimal number (12.0)"),
            (True, "a boolean (true)"),
        ]:
            if value is True and takes_bool:
                continue
            with pytest.raises(ValidationError) as caught:
                model.model_validate({**base, name: value})
            error = explain(caught.value.errors())
            assert error.param == name, (name, value, error.message)
            assert error.message.endswith(f"not {said}"), error.message
    nested = [
        (
            {"prompt": [1, 2.0]},
            "prompt.1",
            "must be an integer, a string or an array, not a decimal number (2.0)",
        ),
        ({"mm_processor_kwargs": {"max_frames": "8"}}, "mm_processor_kwargs.max_frames", "not a string"),
        ({"stop_token_ids": [True]}, "stop_token_ids.0", "must be an integer, not a boolean (true)"),
        ({"temperature": "0.5"}, "temperature", "must be a number, not a string"),
        ({"top_p": True}, "top_p", "must be a number, not a boolean (true)"),
    ]
    for change, param, said in nested:
        if not set(change) <= set(model.model_fields):
            continue
        with pytest.raises(ValidationError) as caught:
            model.model_validate({**base, **change})
        error = explain(caught.value.errors())
        assert (error.param, error.message.split(": ", 1)[1].endswith(said)) == (param, True), error.message
    assert (
        model.model_validate({**base, "max_tokens": 12, "seed": -3, "top_k": 5, "temperature": 1}).max_tokens
        == 12
    )


def test_an_error_never_quotes_a_huge_input_back():
    key = "k" * 1_000_000
    with pytest.raises(ValidationError) as caught:
        chat(mm_processor_kwargs={key: 1})
    error = explain(caught.value.errors())
    assert error.param.startswith("mm_processor_kwargs.kkk") and len(error.param) < 100
    assert len(error.message) < 300, error.message
    huge = "x" * 10_000_000
    with pytest.raises(ValidationError) as caught:
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": huge}]}])
    error = explain(caught.value.errors())
    assert error.message == "messages.0.content.0.image_url: must be an object, not a string"
