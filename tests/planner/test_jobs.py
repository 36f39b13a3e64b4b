"""What-if jobs end to end: the planner service takes them over REST and a real Celery worker
(`python -m celery --app=services.planner.jobs worker --pool=solo`) plans them, with the real
redis-server as broker and result backend and the real nats-server under the planner."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from PIL import Image

from common.infra import NatsServer, RedisServer, free_port
from common.planner.paper_profiles import profiles_from
from common.planner.types import METHOD_KINDS
from common.planner.workloads import generate
from services.planner.jobs import JobTimeLimit, reporter

NAMESPACE = "jobs-test"
AUTH = {"Authorization": "Bearer jobs-key"}  # the planner's writes ask for a key (TRIDENT_PLANNER_KEY)


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RedisServer]]:
    """The planner service and one Celery worker; yields the planner's URL and the Redis server."""
    workdir = tmp_path_factory.mktemp("jobs")
    with NatsServer(workdir=workdir / "nats") as nats, RedisServer(workdir=workdir / "redis") as redis_server:
        port = free_port()
        env = {
            **os.environ,
            "TRIDENT_NATS_URL": nats.url,
            "TRIDENT_REDIS_URL": redis_server.url,
            "TRIDENT_NAMESPACE": NAMESPACE,
            "TRIDENT_PLANNER_KEY": "jobs-key",
            "TRIDENT_HTTP_PORT": str(port),
            "TRIDENT_TTFT_SLO": "1.0",
            "TRIDENT_TBT_SLO": "0.2",
        }
        worker = [
            "--pool=solo",
            "--concurrency=1",
            "--loglevel=INFO",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
        ]
        commands = {
            "planner": [sys.executable, "-m", "services.planner"],
            "worker": [sys.executable, "-m", "celery", "--app=services.planner.jobs", "worker", *worker],
        }
        procs = {}
        for name, argv in commands.items():
            log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, procs, workdir)
            yield url, redis_server
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_ready(url: str, procs: dict[str, subprocess.Popen], workdir: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            assert proc.poll() is None, (workdir / f"{name}.log").read_text()[-3000:]
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError((workdir / "planner.log").read_text()[-3000:])


def _finish(url: str, job_id: str, timeout: float = 90) -> tuple[dict, set[str]]:
    """Poll a job until it ends; returns its last body and every state seen."""
    states: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"{url}/plan/jobs/{job_id}", timeout=5).json()
        states.add(body["state"])
        if body["state"] in ("SUCCESS", "FAILURE"):
            return body, states
        assert 0.0 <= body["progress"] <= 1.0
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} still {states}")


SLO = {"ttft": 0.5, "tbt": 0.1}


@pytest.mark.slow
def test_workload_job_runs_to_a_chart(planner: tuple[str, RedisServer]) -> None:
    url, redis_server = planner
    workload = {"shape": "textcaps", "rate": 4.0, "num_requests": 80, "seed": 3}
    reply = httpx.post(
        f"{url}/plan/jobs",
        json={"workload": workload, "slo": SLO, "instances": 4, "profiles": "paper:llava-1.5-7b"},
        headers=AUTH,
        timeout=30,
    )
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]
    body, states = _finish(url, job_id)
    assert body["state"] == "SUCCESS", body["error"]
    assert states <= {"PENDING", "STARTED", "PROGRESS", "SUCCESS"}
    assert body["progress"] == 1.0 and body["requests"] == 80 and body["instances"] == 4
    plan = body["result"]["plan"]
    assert plan["method"] in METHOD_KINDS and sum(plan["replicas"].values()) == 4
    simulated = [c["goodput"] for c in plan["candidates"] if not c["pruned"]]
    assert simulated and plan["goodput"] == max(simulated)
    assert all(c["bound"] < plan["goodput"] for c in plan["candidates"] if c["pruned"])
    assert body["result"]["trace"]["count"] == 80
    png = httpx.get(url + body["chart"], timeout=10)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png.content))
    image.verify()
    assert image.size[0] >= 400
    # Celery's keys (queue, results) live under the namespace, beside the planner's job record.
    keys = {k.decode() for k in redis.Redis.from_url(redis_server.url).keys("*")}
    assert f"{NAMESPACE}:planjob:{job_id}" in keys
    assert f"{NAMESPACE}:jobs:celery-task-meta-{job_id}" in keys
    assert not [k for k in keys if not k.startswith(f"{NAMESPACE}:")]


@pytest.mark.slow
def test_a_rate_job_finds_how_many_instances_serve_it(planner: tuple[str, RedisServer]) -> None:
    url, _ = planner
    job = {**GOOD, "workload": {"shape": "pope", "rate": 4.0, "num_requests": 60, "seed": 5}}
    job = {**job, "instances": 32, "rate": 60.0}
    reply = httpx.post(f"{url}/plan/jobs", json=job, headers=AUTH, timeout=30)
    assert reply.status_code == 202, reply.text
    body, _ = _finish(url, reply.json()["id"])
    assert body["state"] == "SUCCESS", body["error"]
    sizing, plan = body["result"]["sizing"], body["result"]["plan"]
    n = sizing["recommended_instances"]
    assert 3 <= n <= 32 and sum(plan["replicas"].values()) == n and plan["goodput"] >= 60
    assert sizing["tried"][str(n)] >= 60 and (n == 3 or sizing["tried"][str(n - 1)] < 60)


@pytest.mark.slow
def test_inline_trace_and_profiles(planner: tuple[str, RedisServer]) -> None:
    url, _ = planner
    trace = [dataclasses.asdict(e) for e in generate("pope", rate=3.0, num_requests=40, seed=1)]
    profiles = profiles_from("paper:llava-1.5-7b").to_dict()
    reply = httpx.post(
        f"{url}/plan/jobs",
        json={"trace": trace, "slo": SLO, "instances": 3, "profiles": profiles},
        headers=AUTH,
        timeout=30,
    )
    assert reply.status_code == 202, reply.text
    body, _ = _finish(url, reply.json()["id"])
    assert body["state"] == "SUCCESS", body["error"]
    assert body["result"]["trace"]["count"] == 40
    assert sum(body["result"]["plan"]["replicas"].values()) == 3


GOOD = {
    "workload": {"shape": "pope", "rate": 2.0},
    "slo": SLO,
    "instances": 3,
    "profiles": "paper:llava-1.5-7b",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"slo": None}, "slo"),
        ({"slo": {"ttft": 0, "tbt": 0.1}}, "slo.ttft"),
        ({"instances": 2}, "instances"),  # fewer than the three stages
        ({"rate": 0}, "rate"),
        ({"workload": {"shape": "imagenet", "rate": 2.0}}, "workload.shape"),
        ({"workload": {"shape": "pope", "rate": -1}}, "workload.rate"),
        ({"workload": None}, "trace"),  # neither trace nor workload
        ({"trace": [{"arrival": 0, "prompt_tokens": 5, "output_tokens": 1}] * 2}, "trace"),  # both
        (
            {"workload": None, "trace": [{"arrival": 0, "prompt_tokens": "x", "output_tokens": 1}] * 2},
            "trace.0.prompt_tokens",
        ),
        (
            {
                "workload": None,
                "trace": [{"arrival": 0, "prompt_tokens": 5, "image_tokens": 9, "output_tokens": 1}] * 2,
            },
            "trace",
        ),
        ({"profiles": "cluster"}, "profiles"),  # no instance has published one here
        ({"profiles": "paper:gpt-9"}, "profiles"),
        ({"profiles": "/etc/passwd"}, "profiles"),  # files are the CLI's; the service takes no paths
        ({"profiles": {"curves": {}}}, "profiles"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    planner: tuple[str, RedisServer], change: dict, param: str
) -> None:
    url, _ = planner
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    reply = httpx.post(f"{url}/plan/jobs", json=body, headers=AUTH, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.slow
def test_unknown_jobs_are_404(planner: tuple[str, RedisServer]) -> None:
    url, _ = planner
    for path in ("/plan/jobs/nope", "/plan/jobs/nope/chart.png"):
        reply = httpx.get(url + path, timeout=5)
        assert reply.status_code == 404 and "no job 'nope'" in reply.json()["error"]["message"]
    assert httpx.post(url + "/plan/jobs", content=b"{", headers=AUTH, timeout=5).status_code == 400


def test_a_job_past_its_time_limit_fails_saying_so() -> None:
    now = [0.0]
    reports: list[tuple[float, str]] = []
    progress = reporter(lambda f, m: reports.append((f, m)), limit=10.0, clock=lambda: now[0])
    progress(0.0, "simulating 1E1P1D")
    now[0] = 0.1
    progress(0.1, "too soon to report")
    now[0] = 9.0
    progress(0.5, "simulating 2E1P1D")
    assert reports == [(0.0, "simulating 1E1P1D"), (0.5, "simulating 2E1P1D")]
    now[0] = 10.5
    with pytest.raises(JobTimeLimit, match="over its 10 s limit"):
        progress(0.6, "simulating 1E2P1D")
