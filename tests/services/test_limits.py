"""The gateway's limits, each an OpenAI error a client can act on: 401 without the key, 413 for a
body past the cap (declared or streamed), 429 with Retry-After past the in-flight cap or a full
stage queue, 504 past the request's deadline — after which the request's work is gone everywhere —
and SSE comments that keep a waiting stream alive."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.deploy import running_cluster
from tests.helpers.chat import body, openai_error, user_message
from tests.helpers.deployments import extra_gateway as gateway
from tests.helpers.probes import instances, metric, pid_of


@pytest.fixture(scope="module")
def epd(tiny_model_dir, tmp_path_factory):
    # A frozen worker stays registered for the whole of a test (the queue and keep-alive cases).
    ttl = {"TRIDENT_HEARTBEAT_TTL": "60"}
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("limits"), "epd", env=ttl) as c:
        yield c


def long_stream(url: str, **headers: str) -> httpx.Response:
    """A streamed request that runs until closed (1800 tokens, eos ignored)."""
    client = httpx.Client(timeout=60)
    payload = body(max_tokens=1800, stream=True, ignore_eos=True, messages=user_message([], "go on"))
    request = client.build_request("POST", url + "/v1/chat/completions", json=payload, headers=headers)
    return client.send(request, stream=True)


def test_an_api_key_is_required_when_keys_are_set(epd):
    url = gateway(epd, "gateway-keys", TRIDENT_API_KEYS="k1,k2")
    error = openai_error(httpx.post(url + "/v1/chat/completions", json=body()), 401)
    assert error["type"] == "authentication_error"
    wrong = {"Authorization": "Bearer nope"}
    openai_error(httpx.post(url + "/v1/chat/completions", json=body(), headers=wrong), 401)
    right = httpx.post(
        url + "/v1/chat/completions", json=body(), headers={"Authorization": "Bearer k2"}, timeout=30
    )
    assert right.status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # outside /v1: no key needed
    epd.stop("gateway-keys")


def test_a_body_past_the_cap_is_413_whether_declared_or_streamed(epd):
    url = gateway(epd, "gateway-small-body", TRIDENT_MAX_BODY_BYTES=str(1 << 20))
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # 1 GB declared, 5 bytes sent
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1073741824\r\n\r\n{"a":'
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply

    def chunks():  # 3 MB with no Content-Length: refused as it streams in
        for _ in range(48):
            yield b" " * 65536

    streamed = httpx.post(
        url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "1 MB" in openai_error(streamed, 413)["message"]
    assert httpx.post(url + "/v1/chat/completions", json=body(), timeout=30).status_code == 200
    epd.stop("gateway-small-body")


def test_past_the_in_flight_cap_a_request_is_429_with_retry_after(epd):
    url = gateway(epd, "gateway-one", TRIDENT_MAX_IN_FLIGHT="1")
    stream = long_stream(url)
    try:
        busy = httpx.post(url + "/v1/chat/completions", json=body(), timeout=30)
        assert openai_error(busy, 429)["type"] == "rate_limit_error"
        assert int(busy.headers["retry-after"]) >= 1
    finally:
        stream.close()
    deadline = time.monotonic() + 10
    while metric(url, "trident_gateway_in_flight") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.post(url + "/v1/chat/completions", json=body(), timeout=30).status_code == 200
    epd.stop("gateway-one")


def test_a_full_stage_queue_turns_new_requests_away(epd):
    """The worker is frozen, so tasks wait in the queue; past the limit, the gateway says 429."""
    url = gateway(epd, "gateway-queue", TRIDENT_MAX_QUEUED_TASKS="2")
    (worker,) = instances(epd, "prefill")
    os.kill(pid_of(worker), signal.SIGSTOP)
    waiting = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                kwargs={"json": {"model": "tiny-llava", "prompt": "x", "max_tokens": 2},
                                        "timeout": 60}) for _ in range(3)]  # fmt: skip
    try:
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 10
        while (
            metric(url, 'trident_gateway_queued_tasks{stage="prefill"}') < 2 and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny-llava", "prompt": "x"}, timeout=30)
        assert "prefill queue is full" in openai_error(refused, 429)["message"]
        assert "retry-after" in refused.headers
    finally:
        os.kill(pid_of(worker), signal.SIGCONT)
        for t in waiting:
            t.join(60)
    epd.stop("gateway-queue")


def test_past_its_deadline_a_request_is_504_and_its_work_is_freed(epd):
    url = gateway(epd, "gateway-hasty", TRIDENT_REQUEST_TIMEOUT="1")
    (worker,) = instances(epd, "decode")
    payload = body(max_tokens=1900, ignore_eos=True, messages=user_message([], "a long story"))
    started = time.monotonic()
    late = httpx.post(url + "/v1/chat/completions", json=payload, timeout=30)
    assert openai_error(late, 504)["type"] == "timeout_error" and time.monotonic() - started < 5
    total = metric(worker["http_address"], "trident_total_kv_blocks")
    deadline = time.monotonic() + 10
    while metric(worker["http_address"], "trident_free_kv_blocks") < total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(worker["http_address"], "trident_free_kv_blocks") == total, "the request still holds KV"
    epd.stop("gateway-hasty")


def test_a_waiting_stream_gets_keep_alive_comments(epd):
    """A stream whose worker is frozen still hears from the gateway every TRIDENT_SSE_KEEPALIVE."""
    url = gateway(epd, "gateway-chatty", TRIDENT_SSE_KEEPALIVE="0.3")
    (worker,) = instances(epd, "decode")
    os.kill(pid_of(worker), signal.SIGSTOP)
    try:
        stream = long_stream(url)
        lines = stream.iter_lines()
        seen = [next(lines) for _ in range(6)]
        stream.close()
    finally:
        os.kill(pid_of(worker), signal.SIGCONT)
    assert ": keep-alive" in seen
    epd.stop("gateway-chatty")


def test_unknown_routes_and_methods_answer_in_the_openai_shape(epd):
    openai_error(httpx.get(epd.url + "/v1/nothing-here"), 404)
    openai_error(httpx.get(epd.url + "/v1/chat/completions"), 405)


def test_a_request_cancelled_while_queued_is_dropped_unrun(epd):
    """Its client leaves while its task waits for a (frozen) worker: when the worker comes back, it
    drops the task without running it (the gateway's tombstone, or the cancel it heard)."""
    (worker,) = instances(epd, "prefill")
    address = worker["http_address"]
    generated = metric(address, "trident_tokens_generated_total")
    unrun = metric(address, "trident_cancelled_unrun_total")
    os.kill(pid_of(worker), signal.SIGSTOP)
    try:
        stream = long_stream(epd.url)
        next(stream.iter_lines())  # the gateway accepted it (its first chunk); no token can come
        stream.close()
        deadline = time.monotonic() + 10
        while metric(epd.url, "trident_gateway_in_flight") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(pid_of(worker), signal.SIGCONT)
    deadline = time.monotonic() + 15
    while metric(address, "trident_cancelled_unrun_total") < unrun + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(address, "trident_cancelled_unrun_total") == unrun + 1
    assert metric(address, "trident_tokens_generated_total") == generated
