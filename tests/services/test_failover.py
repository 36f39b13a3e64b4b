"""Failover in seconds, not at the ack deadline: a dead instance's silence is noticed, it is fenced,
and its tasks go to a live replica at once. A decoder killed or frozen mid-stream is replaced and
the seeded answer is the one an uninterrupted run gives; a frozen one that wakes up leaves; the
requests of a dead gateway are dropped everywhere; encoders and prefills die under load and every
request still ends with its answer.

Two deployments serve every case (tests/helpers/faults.py): E+P+D with two of each stage, and EPD
with two instances, each shared with test_recovery.py. After each test its victim is restarted
and the test after it finds the deployment whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import nats
import openai
import pytest

from common.protocol import Fence, Heartbeat, decode, encode
from tests.helpers.chat import client_for, unstruck, user_message
from tests.helpers.deployments import shared
from tests.helpers.faults import TWO_EPD, TWO_OF_EACH, healed, name_of_pid
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import held, instances, metric, pid_of, wait_for

LONG = 1500  # tokens: still decoding when the victim is struck, whatever the machine's speed
ASK = dict(
    model="tiny-llava", max_tokens=LONG, temperature=1.0, top_p=0.9, seed=5, extra_body={"ignore_eos": True}
)
two_of_each = shared(TWO_OF_EACH)
two_epd = shared(TWO_EPD)


@pytest.fixture
def replicas(two_of_each):
    yield from healed(two_of_each)


@pytest.fixture
def epd_pair(two_epd):
    yield from healed(two_epd)


def streamed(client, messages, on_chunk=None) -> tuple[str, int, float]:
    """A stream's text, its token count and the longest gap between two of its chunks."""
    pieces, usage, last, stall = [], None, time.monotonic(), 0.0
    stream = client.chat.completions.create(
        **ASK, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        now = time.monotonic()
        stall, last = max(stall, now - last), now
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
        if on_chunk is not None:
            on_chunk(len(pieces))
    return "".join(pieces), usage.completion_tokens, stall


def total_held(cluster, role: str) -> float:
    return sum(held(i) for i in instances(cluster, role))


@pytest.mark.parametrize("stop", ["kill", "freeze"])
def test_a_decoder_that_dies_mid_stream_is_replaced_within_seconds(replicas, image_urls, stop):
    cluster = replicas
    client = client_for(cluster)
    messages = user_message(image_urls[:1], "Tell me a long story")
    expected = unstruck(cluster, **ASK, messages=messages)  # the same for both cases: asked once
    victim = []

    def strike(chunks: int) -> None:
        if chunks == 20 and not victim:
            victim.append(next(i for i in instances(cluster, "decode") if held(i) == 1))
            os.kill(pid_of(victim[0]), signal.SIGKILL if stop == "kill" else signal.SIGSTOP)

    text, tokens, stall = streamed(client, messages, strike)
    assert text == expected and tokens == LONG
    # A kill is judged at 1.5 s, a freeze at TRIDENT_UNRESPONSIVE_AFTER (5 s); the ack deadline is 30 s.
    assert stall < 15, f"the stream stalled {stall:.1f}s: the task waited for its ack deadline"
    if stop == "freeze":
        name = name_of_pid(cluster, pid_of(victim[0]))
        os.kill(pid_of(victim[0]), signal.SIGCONT)
        try:
            code = cluster.procs[name].wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the fenced decoder did not leave:\n{cluster.log(name)[-3000:]}")
        assert code == 3, cluster.log(name)[-3000:]  # taken for dead: it left, to be restarted
        assert "taken for dead" in cluster.log(name)


def test_a_worker_held_up_for_seconds_is_waited_for_not_fenced(epd_pair):
    """Its loop held up past TRIDENT_FAILOVER_AFTER but short of TRIDENT_UNRESPONSIVE_AFTER (a busy
    machine, a long pause): its /health hangs, the gateway says it waits, and it serves on — not
    fenced, which would cost a restart and a re-prefill of all it holds."""
    cluster = epd_pair
    before = sorted(i["instance_id"] for i in instances(cluster, "decode"))
    worker = instances(cluster, "decode")[0]
    log_before = len(cluster.log("gateway"))
    os.kill(pid_of(worker), signal.SIGSTOP)
    try:
        wait_for(lambda: "its /health hangs" in cluster.log("gateway")[log_before:], timeout=15)
    finally:
        os.kill(pid_of(worker), signal.SIGCONT)
    answer = client_for(cluster).chat.completions.create(
        model="tiny-llava", max_tokens=3, messages=user_message([], "still there?")
    )
    assert answer.usage.completion_tokens == 3
    assert sorted(i["instance_id"] for i in instances(cluster, "decode")) == before


def test_the_requests_of_a_dead_gateway_are_dropped_everywhere(replicas):
    cluster = replicas
    decoders = instances(cluster, "decode")
    client = client_for(cluster)
    threads = [
        threading.Thread(target=lambda i=i: _swallow(streamed, client, user_message([], f"story {i}")))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: total_held(cluster, "decode") == 3)
    cluster.procs["gateway"].kill()  # its clients are cut off: nobody waits for these requests
    # Judged after failover.GATEWAY_PATIENCE (10 s) of silence.
    wait_for(lambda: sum(held(d) for d in decoders) == 0, timeout=25)
    for d in decoders:
        total = metric(d["http_address"], "trident_total_kv_blocks")
        assert metric(d["http_address"], "trident_free_kv_blocks") == total
    for t in threads:
        t.join(30)
    cluster.procs["gateway"].wait(10)


def _swallow(fn, *args) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


@pytest.mark.parametrize(
    ("role", "signum", "seed"),
    [("encoder", signal.SIGKILL, 300), ("prefill", signal.SIGKILL, 310), ("prefill", signal.SIGTERM, 320)],
    ids=["kill-encoder", "kill-prefill", "drain-prefill"],
)
def test_encoders_and_prefills_die_under_load_and_every_request_ends(replicas, role, signum, seed):
    """A drained instance hands back what a pull under way brings, instead of stranding it until
    its ack deadline; a killed one's are handed on by failover. (Images no earlier test sent: the
    victim owns features the requests pull.)"""
    cluster = replicas
    stage = "encode" if role == "encoder" else "prefill"
    client = client_for(cluster)
    urls = [data_url(make_image(seed + k)) for k in range(3)]

    def ask(i: int) -> str:
        messages = user_message(urls[i % 3 : i % 3 + 1], f"what is in picture {i % 6}?")
        reply = client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=32, temperature=0
        )
        return reply.choices[0].message.content

    expected = [ask(i) for i in range(6)]
    victim = instances(cluster, stage)[0]
    with ThreadPoolExecutor(6) as pool:
        # Enough requests that the load lasts while the test looks for it, on a fast machine too
        # (twelve 16-token ones could all end before it saw four in flight).
        answers = pool.map(ask, range(24))
        # Under load: most of the pool's six requests are in flight at the gateway.
        wait_for(lambda: metric(cluster.url, "trident_gateway_in_flight") >= 4, timeout=30)
        os.kill(pid_of(victim), signum)
        started = time.monotonic()
        assert list(answers) == [expected[i % 6] for i in range(24)]
    assert time.monotonic() - started < 20


async def _gateway_id(nats_url: str) -> str:
    """The gateway's instance id, from its heartbeats."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe("trident.hb.*")
        while True:
            beat = decode((await sub.next_msg(timeout=10)).data, Heartbeat)
            if beat.kind == "gateway":
                return beat.instance_id
    finally:
        await nc.close()


async def _fence(nats_url: str, instance_id: str) -> None:
    """What a watcher that took the instance for dead broadcasts."""
    nc = await nats.connect(nats_url)
    await nc.publish("trident.ctl.fence", encode(Fence(instance_id=instance_id, reason="a test says so")))
    await nc.flush()
    await nc.close()


def test_a_gateway_taken_for_dead_ends_its_requests_and_serves_on(epd_pair):
    """Its requests were dropped everywhere: each ends at once with an error that says so (not at
    its deadline), and the gateway goes on serving under a new name."""
    cluster = epd_pair
    gateway = asyncio.run(_gateway_id(cluster.nats.url))
    client = client_for(cluster)
    ended: dict = {}

    def ask() -> None:
        try:
            streamed(client, user_message([], "a long story"))
        except openai.APIError as exc:
            ended["error"] = exc

    thread = threading.Thread(target=ask)
    thread.start()
    wait_for(lambda: total_held(cluster, "decode") == 1)
    asyncio.run(_fence(cluster.nats.url, gateway))
    started = time.monotonic()
    thread.join(30)
    assert "taken for dead" in str(ended.get("error")), ended
    assert time.monotonic() - started < 10
    wait_for(lambda: total_held(cluster, "decode") == 0, timeout=15)  # dropped on the workers too
    reply = client.chat.completions.create(
        model="tiny-llava", messages=user_message([], "hello"), max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens == 4
    assert asyncio.run(_gateway_id(cluster.nats.url)) != gateway
