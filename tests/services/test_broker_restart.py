"""The broker and the store restart under running streams, and nothing is lost: every stream ends
with the text an uninterrupted run gives (outputs missed while NATS was away are asked for again,
and the instance that has them says them again), and requests that arrive while Redis restarts
wait for it instead of failing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.deploy import running_cluster
from tests.helpers.chat import client_for, user_message
from tests.helpers.probes import metric

STREAMS = 4
TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("restarts"), "e+p+d") as c:
        yield c


def ask(
    cluster, i: int, stream: bool = True, under_way: threading.Semaphore | None = None
) -> tuple[str, int, float]:
    """A greedy answer: its text, its token count and the longest wait between two chunks;
    `under_way` is released at the stream's first token."""
    client = client_for(cluster)
    messages = user_message([], f"tell me story number {i}")
    if not stream:
        reply = client.chat.completions.create(
            model="tiny-llava",
            messages=messages,
            max_tokens=TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content, reply.usage.completion_tokens, 0.0
    chunks = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, usage, last, stall = [], None, time.monotonic(), 0.0
    for chunk in chunks:
        now = time.monotonic()
        stall, last = max(stall, now - last), now
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            if under_way is not None and len(text) == 1:
                under_way.release()
        usage = chunk.usage or usage
    return "".join(text), usage.completion_tokens, stall


def test_streams_finish_unchanged_across_a_nats_crash(cluster):
    expected = [ask(cluster, i, stream=False)[0] for i in range(STREAMS)]
    under_way = threading.Semaphore(0)
    with ThreadPoolExecutor(STREAMS) as pool:
        running = [pool.submit(ask, cluster, i, True, under_way) for i in range(STREAMS)]
        for _ in range(STREAMS):  # every stream has its first token: the crash comes mid-stream
            assert under_way.acquire(timeout=60), "a stream did not start"
        cluster.nats.kill()
        time.sleep(1.0)  # the outage: NATS is away for a second
        cluster.nats.start()
        answers = [r.result(timeout=120) for r in running]
    assert [a[0] for a in answers] == expected
    assert all(a[1] == TOKENS for a in answers)


def test_requests_ride_through_a_redis_restart(cluster):
    expected = ask(cluster, 9, stream=False)[0]
    cluster.redis.kill()
    with ThreadPoolExecutor(2) as pool:
        during = [pool.submit(ask, cluster, 9) for _ in range(2)]
        deadline = time.monotonic() + 30  # both arrived while Redis is away
        while metric(cluster.url, "trident_gateway_in_flight") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.redis.start()
        answers = [r.result(timeout=120) for r in during]
    assert [a[0] for a in answers] == [expected, expected]
    assert httpx.get(cluster.url + "/ready", timeout=5).status_code == 200
