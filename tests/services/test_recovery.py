"""Lost features are recomputed and lost KV is prefilled again: killed instances lose no request.

On the deployments test_failover.py strikes (tests/helpers/faults.py: E+P+D with two of each
stage, EPD with two instances), each victim restarted after its test; what a test counts is what
its own requests added."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from common.roles import Role
from tests.helpers.chat import client_for, unstruck, user_message
from tests.helpers.deployments import shared
from tests.helpers.faults import TWO_EPD, TWO_OF_EACH, healed, name_of_pid
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import draining, held, instances, metric, pid_of, wait_for

# Long enough that the request is still decoding when its decoder is stopped: the client reads
# behind the decoder, and tiny decodes 400 tokens in well under a second on a fast machine, which
# let a drain between two SIGTERMs finish the request by itself (nothing left to resume).
LONG = 1500
two_of_each = shared(TWO_OF_EACH)
two_epd = shared(TWO_EPD)


@pytest.fixture
def replicas(two_of_each):
    yield from healed(two_of_each)


@pytest.fixture
def struck(request, two_of_each, two_epd):
    """The deployment of the method a test is parametrized with, healed after it."""
    yield from healed(two_of_each if request.param == "e+p+d" else two_epd)


def ask(cluster, urls, text="Describe it", max_tokens=12):
    client = client_for(cluster)
    reply = client.chat.completions.create(
        model="tiny-llava", messages=user_message(urls, text), max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content


def counts(cluster, role: str, name: str) -> dict[str, float]:
    """`name` on each instance of `role`, by instance id."""
    return {i["instance_id"]: metric(i["http_address"], name) for i in instances(cluster, role)}


def test_features_of_a_dead_encoder_are_recomputed_elsewhere(replicas):
    cluster = replicas
    picture = [data_url(make_image(400))]  # no earlier test sent it: nothing cached anywhere
    encoded = counts(cluster, "encode", "trident_images_encoded_total")
    fetch_failures = counts(cluster, "prefill", "trident_feature_fetch_failures_total")
    first = ask(cluster, picture)
    encoders = instances(cluster, "encode")
    grew = lambda e: metric(e["http_address"], "trident_images_encoded_total") - encoded[e["instance_id"]]  # noqa: E731
    owner = next(e for e in encoders if grew(e) == 1)
    other = next(e for e in encoders if e is not owner)
    os.kill(pid_of(owner), signal.SIGKILL)
    # The feature index still names the dead encoder: prefill fails to pull, sends it back. Words
    # before the picture keep it out of the prefix the first request cached (an image inside a
    # cached prefix needs no features at all).
    client = client_for(cluster)
    (later,) = user_message(picture, "Describe it")
    later["content"].insert(0, {"type": "text", "text": "Once more."})
    reply = client.chat.completions.create(
        model="tiny-llava", messages=[later], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert first and reply.usage.completion_tokens == 12
    assert grew(other) == 1
    failed = counts(cluster, "prefill", "trident_feature_fetch_failures_total")
    assert sum(failed.values()) - sum(fetch_failures.values()) == 1


def test_kv_of_a_dead_prefill_instance_is_prefilled_again(replicas):
    # ~400 prompt tokens: 400 KB of KV for tiny's 4 layers, past the 256 KB that rides inline in
    # the decode task, so decode must pull it from the prefill instance.
    cluster = replicas
    story = "Tell me about the sea and the boats that sail on it at night. " * 30
    expected = ask(cluster, [], story, 16)
    decoders = instances(cluster, "decode")
    pull_failures = sum(counts(cluster, "decode", "trident_kv_pull_failures_total").values())
    prefilled = counts(cluster, "prefill", "trident_prefills_total")
    for d in decoders:  # frozen: the decode task waits in the queue
        os.kill(pid_of(d), signal.SIGSTOP)
    answer: list[str] = []
    thread = threading.Thread(target=lambda: answer.append(ask(cluster, [], story, 16)))
    thread.start()
    try:
        # Prefilled, and the decode task published (it waits for the frozen decoders): the KV it
        # names lives only in the prefill instance that ran it now.
        deadline = time.monotonic() + 20
        while cluster.unacked_tasks(Role.DECODE) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        now = counts(cluster, "prefill", "trident_prefills_total")
        (holder,) = [
            i for i in instances(cluster, "prefill") if now[i["instance_id"]] > prefilled[i["instance_id"]]
        ]
        os.kill(pid_of(holder), signal.SIGKILL)  # its KV goes with it; the other prefill instance serves
    finally:
        for d in decoders:
            os.kill(pid_of(d), signal.SIGCONT)
    thread.join(120)
    assert answer == [expected]
    assert sum(counts(cluster, "decode", "trident_kv_pull_failures_total").values()) == pull_failures + 1


def test_sigterm_drains_a_decoder_mid_stream(replicas):
    """SIGTERM: stop pulling, finish what is held, deregister, exit 0 — the stream is not cut, and
    the instance answers /ready (503, draining) and /metrics until it leaves."""
    cluster = replicas
    stream = client_for(cluster).chat.completions.create(
        model="tiny-llava",
        messages=user_message([], "a long story"),
        max_tokens=LONG,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks, while_draining, decoder = [], [], None
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 5:
            decoder = next(i for i in instances(cluster, "decode") if held(i) == 1)
            os.kill(pid_of(decoder), signal.SIGTERM)
        if len(chunks) == 20:  # early: a client behind the stream must still find it draining
            while_draining.append(httpx.get(decoder["http_address"] + "/ready", timeout=5).status_code)
            while_draining.append(metric(decoder["http_address"], "trident_held_requests"))
    name = name_of_pid(cluster, pid_of(decoder))
    try:  # before the checks: a failed one must not leave the next test a decoder on its way out
        code = cluster.procs[name].wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the decoder was still running 30 s after its stream ended:\n{cluster.log(name)[-3000:]}"
        )
    assert chunks[-1].usage.completion_tokens == LONG
    assert while_draining == [503, 1]
    assert code == 0, cluster.log(name)[-3000:]
    wait_for(lambda: decoder["instance_id"] not in [i["instance_id"] for i in instances(cluster, "decode")])


@pytest.mark.parametrize(
    ("struck", "stop"), [("e+p+d", "kill"), ("epd", "kill"), ("e+p+d", "term-twice")], indirect=["struck"]
)
def test_a_request_whose_decoder_dies_resumes_from_the_tokens_the_client_has(struck, image_urls, stop):
    """The instance decoding a streamed request is killed (or told twice to stop, which gives its
    held tasks back at once): the task is redelivered, the request is prefilled again over its
    prompt and the tokens already streamed (the gateway's journal), and decoding goes on elsewhere.
    Seeded sampling makes the uninterrupted answer the oracle: a resume from anything but exactly
    the streamed tokens, or a repeat of them, would change the text."""
    cluster, role = struck, "decode"
    resumed = counts(cluster, role, "trident_resumed_tokens_total")
    client = client_for(cluster)
    ask = dict(
        model="tiny-llava", messages=user_message(image_urls[:1], "Tell me a long story"),
        max_tokens=LONG, temperature=1.0, top_p=0.9, seed=11, extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = unstruck(cluster, **ask)  # e+p+d's two cases ask it once
    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    pieces, killed, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
        if len(pieces) == 20 and killed is None:
            killed = next(i for i in instances(cluster, role) if held(i) == 1)
            if stop == "kill":
                os.kill(pid_of(killed), signal.SIGKILL)
            else:
                os.kill(pid_of(killed), signal.SIGTERM)
                draining(killed)  # the second signal is a second one, not merged into the first
                os.kill(pid_of(killed), signal.SIGTERM)
    assert killed is not None
    assert "".join(pieces) == expected
    assert usage.completion_tokens == LONG
    survivors = [i for i in instances(cluster, role) if i["instance_id"] != killed["instance_id"]]
    grew = sum(
        metric(i["http_address"], "trident_resumed_tokens_total") - resumed.get(i["instance_id"], 0)
        for i in survivors
    )
    assert grew >= 19
    if stop == "term-twice":
        proc = next(p for p in cluster.procs.values() if p.pid == pid_of(killed))
        assert proc.wait(10) == 0
