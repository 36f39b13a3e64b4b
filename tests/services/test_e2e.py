"""The deployed system against HF `generate`, under each of E+P+D, EP+D, ED+P and EPD: one deployment
per method, shared (tests/helpers/deployments.py) with every other module that asks for it."""

from __future__ import annotations

import time

import httpx
import pytest

from common.protocol import TraceRecord
from tests.helpers.chat import QUESTION, client_for, reference, user_message
from tests.helpers.probes import read_store


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


def test_the_trace_has_each_outcome_and_instances_publish_their_profiles(cluster):
    """Issue 5's inputs to the planner: every finished request is traced with the TTFT, TBT p90 and
    SLO verdict the gateway measured, and every worker published the profile its heartbeat names."""
    client = client_for(cluster)
    answer = client.completions.create(
        model="tiny-llava", prompt="USER: hi ASSISTANT:", max_tokens=6, temperature=0, stream=True
    )
    rid = {chunk.id for chunk in answer}.pop()

    def traced() -> TraceRecord | None:
        found = [t for _, t in read_store(cluster, lambda s: s.requests.trace()) if t.request_id == rid]
        return found[0] if found else None

    deadline = time.monotonic() + 10
    while (trace := traced()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trace is not None and trace.output_tokens == 6 and trace.finish_reason == "length"
    assert trace.ttft is not None and 0 < trace.ttft < 60
    assert trace.tbt_p90 is not None and 0 <= trace.tbt_p90 < 60
    assert trace.slo_met == (trace.ttft <= 5.0 and trace.tbt_p90 <= 0.5)  # the default SLOs
    if "first_token" in trace.stages:  # the gateway's TTFT starts before routing and ends on receipt
        assert trace.ttft >= trace.stages["first_token"] - trace.stages["arrival"] - 0.05

    profiles = {p.profile_id: p for p in read_store(cluster, lambda s: s.planning.profiles())}
    instances = cluster.instances()
    assert instances and len(profiles) == len({tuple(i["roles"]) for i in instances})
    for inst in instances:
        profile = profiles[inst["profile_id"]]
        assert list(profile.roles) == sorted(inst["roles"]) and profile.model == "tiny-llava"
        assert profile.hardware.startswith("cpu:") and profile.max_model_len == 2048
        if "encode" in inst["roles"]:  # the budgets in use are the profile's
            assert profile.encode and profile.feature_bytes_per_image_token == 64 * 4
            assert profile.image_budget == inst["budgets"]["image_budget"]
        if {"prefill", "decode"} & set(inst["roles"]):
            assert profile.prefill and profile.decode and profile.num_kv_blocks > 0
            assert profile.token_budget == inst["budgets"]["token_budget"]
        metrics = httpx.get(inst["http_address"] + "/metrics", timeout=5).text
        assert f'profile_id="{inst["profile_id"]}"' in metrics
        assert "trident_token_budget{" in metrics


def test_a_video_for_a_model_without_video_is_a_400(cluster):
    """LLaVA takes no clips: a `video_url` part is refused saying so, before anything is fetched."""
    body = {
        "model": "tiny-llava", "max_tokens": 2,
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
            {"type": "text", "text": "what happens?"},
        ]}],
    }  # fmt: skip
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "video_unsupported"
    assert "takes no video" in reply.json()["error"]["message"]
