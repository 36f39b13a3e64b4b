"""What third-party benchmark clients (`vllm bench serve`, aiperf) send is accepted and answered the
way they measure it: a chunk per token, usage while streaming, token-id prompts kept as ids."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers.chat import user_message


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, timeout=60)


def sse_events(cluster, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", cluster.url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_health_answers_before_a_run(epd):
    assert httpx.get(epd.url + "/health", timeout=5).json() == {"status": "ok"}


def test_vllm_chat_payload_streams_a_chunk_per_token_with_usage(epd, image_urls):
    # `vllm bench serve --backend openai-chat --ignore-eos`, one image: exactly as it sends it.
    body = {
        "model": "tiny-llava", "messages": user_message(image_urls[:1], "describe"),
        "max_completion_tokens": 12, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    events = sse_events(epd, "/v1/chat/completions", body)
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 12
    tokens = [e for e in events if e["choices"] and "content" in e["choices"][0]["delta"]]
    tokens = [e for e in tokens if "role" not in e["choices"][0]["delta"]]
    # Every token has its own chunk, even one whose text is held back (clients time ITL per chunk),
    # and each carries the usage so far: the prompt as tokenised and the tokens received. (Text
    # still held at the end, an unfinished UTF-8 character, comes in one more chunk.)
    assert sorted({e["usage"]["completion_tokens"] for e in tokens}) == list(range(1, 13))
    assert [e["usage"]["completion_tokens"] for e in tokens][:12] == list(range(1, 13))
    assert {e["usage"]["prompt_tokens"] for e in events} == {usage["prompt_tokens"]}
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in events)  # fmt: skip


def test_vllm_completions_payload_is_accepted(epd):
    body = {
        "model": "tiny-llava", "prompt": "a story about", "repetition_penalty": 1.0, "max_tokens": 6,
        "logprobs": None, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    events = sse_events(epd, "/v1/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 6
    running = [
        e["usage"]["completion_tokens"]
        for e in events
        if e["choices"] and not e["choices"][0]["finish_reason"]
    ]
    assert set(running) == set(range(1, 7))


def test_token_id_prompt_goes_to_the_engine_as_ids(epd, tokenizer):
    text = "What is in the picture? Describe it"
    ids = tokenizer(text)["input_ids"]
    greedy = {"model": "tiny-llava", "max_tokens": 8, "temperature": 0}
    by_text = post(epd, "/v1/completions", {**greedy, "prompt": text}).json()
    by_ids = post(epd, "/v1/completions", {**greedy, "prompt": ids}).json()
    nested = post(epd, "/v1/completions", {**greedy, "prompt": [ids]}).json()
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] == nested["choices"][0]["text"]
    # Ids that do not survive decode + re-encode (no BOS here; the tokenizer would add one) are kept.
    bare = ids[1:] if ids[0] == tokenizer.bos_token_id else ids
    resp = post(epd, "/v1/completions", {**greedy, "prompt": bare}).json()
    assert resp["usage"]["prompt_tokens"] == len(bare)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, 5, 10**6], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([1, 4, 7], "image token id"),  # the tiny checkpoint's <image> is id 4
    ],
    ids=["beyond vocab", "negative", "image token"],
)
def test_bad_token_id_prompts_get_a_400(epd, tokenizer, prompt, message):
    assert tokenizer.convert_tokens_to_ids("<image>") == 4
    resp = post(epd, "/v1/completions", {"model": "tiny-llava", "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert message in error["message"] and error["param"] == "prompt"


def test_a_repetition_penalty_out_of_range_is_refused_naming_it(epd):
    """vLLM's clients send repetition_penalty (supported since issue 48); one that is not > 0 is a 400."""
    body = {"model": "tiny-llava", "prompt": "hi", "repetition_penalty": 0}
    resp = post(epd, "/v1/completions", body)
    assert resp.status_code == 400 and "repetition_penalty" in resp.json()["error"]["message"]


def test_file_urls_say_how_to_send_the_image(epd):
    body = {"model": "tiny-llava", "messages": user_message(["file:///tmp/cat.png"], "x"), "max_tokens": 2}
    resp = post(epd, "/v1/chat/completions", body)
    assert resp.status_code == 400
    assert "data: URL" in resp.json()["error"]["message"]
    assert "--custom-ensure-client-side-data" in resp.json()["error"]["message"]
