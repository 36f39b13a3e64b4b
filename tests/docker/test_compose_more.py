"""What Compose adds beyond the smoke test, in CI's second step (`.ci/run`; `make test` leaves
tests marked `extended` out): each hybrid profile answering alone, `docker compose stop` draining a
decode replica mid-stream, and `trident follow-plan` applying the planner's plan with no stream
lost. A stack of its own (tests/docker/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from common.compose import Method, load_compose, plan_scale
from common.protocol import Plan
from tests.docker.stack import LONG, REPO, STORY, ask, client_of, story_answer
from tests.helpers.chat import QUESTION, reference, user_message
from tests.helpers.images import data_url, make_image
from trident.launcher.compose_follow import ComposeProject

pytestmark = [pytest.mark.docker, pytest.mark.extended]


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
