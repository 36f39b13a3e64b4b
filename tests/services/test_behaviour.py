"""Replicas share work, routing skips the encoder when it can, and a cancelled stream frees its KV.

On the E+P+D deployment with two of each stage that the fault tests strike (tests/helpers/faults.py),
made whole before this module: what a test counts is what its own requests added. For the scarce-KV
case its two decoders give way to one with little KV, and are put back after it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.chat import client_for, user_message
from tests.helpers.deployments import shared
from tests.helpers.faults import TWO_OF_EACH, healed, replaced_decoder
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import instances, metric

two_of_each = shared(TWO_OF_EACH)
PICTURE = 470  # an image no other module sends: its features are cached nowhere before this module


@pytest.fixture(scope="module")
def two_decoders(two_of_each):
    """Two decode instances (and two of each other stage), every one registered."""
    yield from healed(two_of_each)


def counts(cluster, role: str, name: str) -> dict[str, float]:
    """`name` on each instance of `role`, by instance id."""
    return {i["instance_id"]: metric(i["http_address"], name) for i in instances(cluster, role)}


def test_two_decode_replicas_share_twenty_concurrent_requests(two_decoders, image_urls):
    client = client_for(two_decoders)
    before = counts(two_decoders, "decode", "trident_decodes_admitted_total")

    def ask(i: int):
        messages = user_message(image_urls[i % 2 : i % 2 + 1] if i % 3 else [], f"question {i}")
        return client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=24, temperature=0
        )

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    assert all(a.usage.completion_tokens > 0 and a.choices[0].finish_reason for a in answers)
    after = counts(two_decoders, "decode", "trident_decodes_admitted_total")
    served = [n - before[i] for i, n in after.items()]
    assert len(served) == 2 and all(n > 0 for n in served), f"decode replicas served {served}"
    assert sum(served) == 20


def test_text_skips_the_encoder_and_a_repeated_image_is_encoded_once(two_decoders):
    client = client_for(two_decoders)

    def encoded() -> float:  # by both encoders: the second request may go to either
        return sum(counts(two_decoders, "encode", "trident_images_encoded_total").values())

    before = encoded()
    routed = metric(two_decoders.url, 'trident_gateway_routed_total{stage="encode"}')
    for _ in range(3):
        client.chat.completions.create(model="tiny-llava", messages=user_message([], "hi"), max_tokens=4)
    assert encoded() == before
    picture = data_url(make_image(PICTURE))
    fresh = user_message([picture], "first time")
    again = user_message([picture], "second time, same picture")
    client.chat.completions.create(model="tiny-llava", messages=fresh, max_tokens=4)
    client.chat.completions.create(model="tiny-llava", messages=again, max_tokens=4)
    assert encoded() == before + 1
    assert metric(two_decoders.url, 'trident_gateway_routed_total{stage="encode"}') >= routed + 1
    # Their heartbeats say so too (what `trident bench` reads from /v1/cluster), within a few beats.
    deadline = time.monotonic() + 10
    while sum(i["images_encoded"] for i in instances(two_decoders, "encode")) != before + 1:
        assert time.monotonic() < deadline, "the encoders' heartbeats never counted the image"
        time.sleep(0.1)


def test_cancelled_stream_releases_its_kv_blocks(two_decoders):
    # Block counts from each instance's /metrics, not from the registry: a heartbeat's second of
    # lag would let the request decode on, unread, for hundreds of tokens before the test cancels.
    engines = instances(two_decoders, "decode") + instances(two_decoders, "prefill")

    def free_blocks() -> int:
        return sum(metric(i["http_address"], "trident_free_kv_blocks") for i in engines)

    def total_blocks() -> int:
        return sum(metric(i["http_address"], "trident_total_kv_blocks") for i in engines)

    def generated() -> float:
        return sum(
            metric(i["http_address"], "trident_tokens_generated_total")
            for i in instances(two_decoders, "decode")
        )

    client = client_for(two_decoders)
    before, total = generated(), total_blocks()
    stream = client.chat.completions.create(
        model="tiny-llava", messages=user_message([], "a long story please"), max_tokens=2000, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 5:
            break
    # The stream is open until close(), and the request decodes on meanwhile: read as little as
    # the check needs before closing (on a loaded machine, each scrape of six instances is slow).
    deadline = time.monotonic() + 5
    while (held := free_blocks()) == total and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.close()
    assert held < total, "the request should hold KV while it runs"
    deadline = time.monotonic() + 15
    while free_blocks() != total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free_blocks() == total_blocks() == total
    stopped_at = generated()
    time.sleep(0.5)
    assert generated() == stopped_at, "the request should have stopped decoding"
    assert stopped_at - before < 1000, "the request should have been cancelled, not run to max_tokens"


def test_requests_wait_for_scarce_decode_kv_instead_of_being_dropped(two_of_each):
    # KV for ~200 tokens on the one decoder (in place of the deployment's two for this test): it
    # holds two of these requests at a time, so most wait for blocks. Each must be answered: a
    # decode task that waits is held, not given back until it runs out of deliveries and is
    # dead-lettered.
    with replaced_decoder(two_of_each, "decode-scarce-kv", TRIDENT_KV_CACHE_BYTES=str(200 << 10)) as c:
        client = client_for(c)

        def ask(i: int):
            return client.chat.completions.create(
                model="tiny-llava", messages=user_message([], f"question {i}"), max_tokens=48, temperature=0
            )

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        assert all(a.usage.completion_tokens > 0 and a.choices[0].finish_reason for a in answers)


def test_the_gateway_counts_the_requests_in_flight(two_decoders):
    """The in-flight gauge follows the requests the gateway serves (it once read 0 always)."""
    client = client_for(two_decoders)
    stream = client.chat.completions.create(
        model="tiny-llava", messages=user_message([], "count me"), max_tokens=1000, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for got, _ in enumerate(stream):
        if got == 3:
            break
    assert metric(two_decoders.url, "trident_gateway_in_flight") == 1
    stream.close()
    deadline = time.monotonic() + 15
    while metric(two_decoders.url, "trident_gateway_in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(two_decoders.url, "trident_gateway_in_flight") == 0
