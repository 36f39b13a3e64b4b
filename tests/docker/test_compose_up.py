"""`docker compose up` as a user runs it: the image built from this repository, answers equal to HF
`generate`, two decode replicas that both serve, a replica killed or stopped mid-stream
while the stream still ends with the right answer, a hybrid profile answering, and the defaults
closed: only the gateway's port on the host, NATS and Redis asking for the deployment's secrets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from common.compose import Method, load_compose, plan_scale
from common.protocol import Plan
from tests.docker.conftest import REPO
from tests.engine.conftest import make_image
from tests.services.conftest import data_url
from tests.services.test_e2e import QUESTION, reference, user_message
from trident.launcher.compose_follow import ComposeProject

pytestmark = pytest.mark.docker
LONG = 1500  # tokens: long enough to strike mid-stream on a busy machine (two docker exec first)


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def ask(stack, messages, max_tokens: int, stream: bool = False, on_chunk=None) -> str:
    client = client_of(stack)
    if not stream:
        reply = client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].message.content
    pieces = []
    chunks = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if on_chunk is not None:
                on_chunk(len(pieces))
    return "".join(pieces)


def metric(stack, service: str, index: int, name: str) -> float:
    """A metric of one replica, read inside its container (worker ports are not published)."""
    script = (
        "import urllib.request as u; "
        "print(u.urlopen('http://127.0.0.1:9000/metrics', timeout=5).read().decode())"
    )
    out = stack.compose("exec", "-T", "--index", str(index), service, "python", "-c", script).stdout
    return sum(float(m) for m in re.findall(rf"^{name}\S* (\S+)$", out, re.M))


def tokens_generated(stack, service: str, index: int) -> float:
    return metric(stack, service, index, "trident_tokens_generated_total")


def container_of(stack, service: str, index: int) -> str:
    labels = {"project": stack.project, "service": service, "container-number": str(index)}
    filters = [arg for k, v in labels.items() for arg in ("--filter", f"label=com.docker.compose.{k}={v}")]
    done = subprocess.run(["docker", "ps", "-q", *filters], capture_output=True, text=True, check=True)
    return done.stdout.strip()


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


def test_two_decode_replicas_both_serve(stack):
    stack.wait_for(lambda: len(stack.instances("decode")) == 2)  # the stack runs two (conftest.py)
    before = [tokens_generated(stack, "decode", i) for i in (1, 2)]
    threads = [
        threading.Thread(target=ask, args=(stack, user_message([], f"story {i}"), 64, True)) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    after = [tokens_generated(stack, "decode", i) for i in (1, 2)]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


STORY = user_message([], "Tell me a long story")
ANSWERS: dict[str, str] = {}  # project -> the story's answer, asked without a strike


def story_answer(stack) -> str:
    """The long story's answer with nothing struck, asked once per stack (it takes a while)."""
    if stack.project not in ANSWERS:
        ANSWERS[stack.project] = ask(stack, STORY, LONG)
    return ANSWERS[stack.project]


def test_a_decode_replica_killed_mid_stream_and_the_stream_completes(stack):
    """Failover hands the stream to the other replica. (Docker does not restart a container killed
    through its API, whatever the restart policy: `start` brings it back, as a user would.)"""
    messages, expected = STORY, story_answer(stack)
    struck: list[str] = []

    def strike(chunks: int) -> None:
        if chunks == 40 and not struck:
            victim = next(i for i in (1, 2) if metric(stack, "decode", i, "trident_held_requests") > 0)
            struck.append(container_of(stack, "decode", victim))
            subprocess.run(["docker", "kill", "-s", "KILL", struck[0]], check=True, capture_output=True)

    assert ask(stack, messages, LONG, stream=True, on_chunk=strike) == expected
    assert struck
    stack.compose("start", "decode")
    stack.wait_for(lambda: len(stack.instances("decode")) == 2)


def test_stopping_decode_mid_stream_drains_it(stack):
    """`docker compose stop` sends SIGTERM: each replica finishes what it holds before it leaves."""
    messages, expected = STORY, story_answer(stack)
    stopping: list[subprocess.Popen] = []

    def stop(chunks: int) -> None:
        if chunks == 40 and not stopping:
            argv = stack.argv("stop", "decode")
            stopping.append(subprocess.Popen(argv, env=stack.env, stdout=subprocess.DEVNULL))

    assert ask(stack, messages, LONG, stream=True, on_chunk=stop) == expected
    assert stopping[0].wait(120) == 0
    stack.compose("start", "decode")
    stack.wait_for(lambda: len(stack.instances("decode")) == 2)


HYBRIDS = {  # profile -> the worker services that run it, as docs/running.md says to switch
    "ep-d": {"worker-ep": 1, "decode": 1},
    "ed-p": {"worker-ed": 1, "prefill": 1},
    "epd": {"worker-epd": 1},
}


@pytest.mark.parametrize("profile", list(HYBRIDS))
def test_each_hybrid_profile_answers(stack, hf_tiny, profile):
    """The profile's workers alone, every other worker scaled to 0 (every profile named, so that the
    other profiles' workers are scaled too), and an answer with an image equal to HF's."""
    compose = load_compose(REPO / "compose.yaml", stack.env)
    counts = HYBRIDS[profile]
    ComposeProject(compose, stack.project, stack.env).scale(counts)
    wanted = sorted(tuple(sorted(compose.services[name].roles)) for name in counts)

    def only_the_profile() -> bool:
        found = httpx.get(stack.url + "/v1/cluster", timeout=10).json()["instances"]
        return sorted(tuple(sorted(i["roles"])) for i in found) == wanted

    stack.wait_for(only_the_profile, timeout=300)
    want, _ = reference(hf_tiny, 1, 16)
    reply = client_of(stack).chat.completions.create(
        model="tiny-llava", messages=user_message([data_url(make_image(0))], QUESTION), max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.content == want


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


# -- the planner's plans, applied -----------------------------------------------------------------
REPLAN = (  # a write: it takes the deployment's planner key (secrets-init made it)
    "import urllib.request as u; k = open('/secrets/planner-key').read().strip(); "
    "u.urlopen(u.Request('http://127.0.0.1:8100/plan/replan?wait=true', method='POST', "
    "headers={'Authorization': 'Bearer ' + k}), timeout=280)"
)


def test_follow_plan_runs_the_planners_plan_and_no_stream_is_lost(stack, hf_tiny):
    """Last: it reshapes the deployment. The planner plans from the requests it has recorded; `trident
    follow-plan` starts the new replicas, then drains the dropped ones while streams are in flight."""
    for i in range(12):  # the recorded workload, on top of the earlier tests'
        ask(stack, user_message([], f"question {i}"), 8)
    stack.compose("exec", "-T", "planner", "python", "-c", REPLAN, timeout=300)
    plan = Plan.model_validate(httpx.get(stack.url + "/v1/cluster", timeout=10).json()["plan"])
    compose = load_compose(REPO / "compose.yaml", stack.env)
    wanted = plan_scale(compose, Method(plan.method), plan.replicas)
    assert sum(wanted.values()) == 4

    want, count = reference(hf_tiny, 0, 200)
    texts: list[str] = []
    threads = [
        threading.Thread(target=lambda: texts.append(ask(stack, user_message([], QUESTION), count, True)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    follow = subprocess.run(
        [str(Path(sys.executable).with_name("trident")), "follow-plan", "--once", "-f", "compose.yaml",
         "-p", stack.project, "--gateway", stack.url],
        cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert follow.returncode == 0, follow.stdout + follow.stderr
    assert f"plan {plan.decision_id}" in follow.stdout and "applied" in follow.stdout, follow.stdout
    for t in threads:
        t.join(300)
    assert texts == [want] * 3  # every stream in flight completed, as HF would have it
    running = ComposeProject(compose, stack.project, stack.env).running()
    assert {n: k for n, k in running.items() if k} == wanted
