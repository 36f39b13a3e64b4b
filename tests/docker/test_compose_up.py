"""`docker compose up` as a user runs it, the smoke test `make test` runs: the image built from this
repository, answers equal to HF `generate`, a decode replica killed mid-stream while the stream
still ends with the right answer, and the defaults closed: only the gateway's port on the host,
NATS and Redis asking for the deployment's secrets.

The rest of what Compose adds runs in CI's second step (test_compose_more.py: hybrid profiles, a
replica stopped mid-stream, the planner's plans applied). What the process deployments already
prove is not proved again here: two decode replicas sharing the load
(tests/services/test_behaviour.py::test_two_decode_replicas_share_twenty_concurrent_requests)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.docker.stack import LONG, REPO, STORY, ask, client_of, container_of, holder, metric, story_answer
from tests.helpers.chat import QUESTION, reference, user_message
from tests.helpers.images import data_url, make_image

pytestmark = pytest.mark.docker


@pytest.mark.parametrize("num_images", [0, 1])
def test_answers_equal_hf_streamed_and_not(stack, hf_tiny, num_images):
    urls = [data_url(make_image(i)) for i in range(num_images)]
    want, count = reference(hf_tiny, num_images, 16)
    messages = user_message(urls, QUESTION)
    reply = client_of(stack).chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=16, temperature=0
    )
    assert reply.choices[0].message.content == want and reply.usage.completion_tokens == count
    chunks = client_of(stack).chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_a_decode_replica_killed_mid_stream_and_the_stream_completes(stack):
    """Failover hands the stream to the other replica. (Docker does not restart a container killed
    through its API, whatever the restart policy: `start` brings it back, as a user would.)"""
    messages, expected = STORY, story_answer(stack)
    struck: list[str] = []

    def strike(chunks: int) -> None:
        if chunks >= 20 and not struck and (victim := holder(stack, "decode")) is not None:
            struck.append(victim)
            subprocess.run(["docker", "kill", "-s", "KILL", victim], check=True, capture_output=True)

    assert ask(stack, messages, LONG, stream=True, on_chunk=strike) == expected
    assert struck
    survivor = next(i for i in (1, 2) if container_of(stack, "decode", i) not in ("", struck[0]))
    assert metric(stack, "decode", survivor, "trident_resumed_tokens_total") >= 19  # it went on from there
    stack.compose("start", "decode")
    stack.wait_for(lambda: len(stack.instances("decode")) == 2)


def test_the_gpu_override_is_valid_compose(stack):
    """compose.gpu.yaml as Compose itself reads it (it is built and run only where a GPU is lent)."""
    done = subprocess.run(
        ["docker", "compose", "-f", "compose.yaml", "-f", "compose.gpu.yaml", "config", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


# -- closed by default ------------------------------------------------------------------------
NATS_WITHOUT_TOKEN = """
import asyncio, nats
async def main():
    nc = await nats.connect("nats://nats:4222", allow_reconnect=False, max_reconnect_attempts=0,
                            connect_timeout=3)
    await nc.subscribe("trident.out.>")
asyncio.run(main())
"""
REDIS_WITHOUT_PASSWORD = """
import redis
redis.Redis(host="redis", socket_timeout=3).set("trident:plan:apply", b"x")
"""
REDIS_WITH_PASSWORD = """
import redis
password = open("/secrets/redis-password").read().strip()
print(redis.Redis(host="redis", password=password, socket_timeout=3).exists("trident:plan:apply"))
"""


def run_in_gateway(stack, script: str):
    return stack.compose("exec", "-T", "gateway", "python", "-c", script, check=False)


def test_only_the_gateway_publishes_a_port(stack):
    listed = stack.compose("ps", "--format", "json").stdout
    containers = [json.loads(line) for line in listed.splitlines() if line.strip()]
    on_host = {c["Service"] for c in containers for p in c.get("Publishers") or [] if p.get("PublishedPort")}
    assert on_host == {"gateway"}, listed


def test_nats_and_redis_refuse_a_client_without_the_secrets(stack):
    nats_try = run_in_gateway(stack, NATS_WITHOUT_TOKEN)
    assert nats_try.returncode != 0 and "Authorization Violation" in nats_try.stderr, nats_try.stderr
    redis_try = run_in_gateway(stack, REDIS_WITHOUT_PASSWORD)
    assert redis_try.returncode != 0 and "Authentication" in redis_try.stderr, redis_try.stderr
    with_it = run_in_gateway(stack, REDIS_WITH_PASSWORD)
    assert with_it.returncode == 0 and with_it.stdout.strip() == "0", with_it.stderr  # nothing written
