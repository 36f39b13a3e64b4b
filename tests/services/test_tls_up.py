"""`trident up --tls`: every channel between the deployment's processes speaks mutual TLS with a
private CA made for the run. The answers stay HF's (image features and KV cross the transfer
ports over TLS), the planner's what-if jobs run (Celery to Redis over TLS), and every port a
process listens on for its peers (NATS, Redis, each worker's HTTP and transfer port) answers a
probe without the deployment's certificate with nothing at all."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest

from common.bus.connection import tls_options
from common.certs import issue
from common.secrets import DeploymentSecrets
from common.tls import Tls
from tests.helpers.chat import QUESTION, client_for, reference, user_message
from tests.tls_probes import only_alerts, probe, probes
from trident.launcher.local_up import LocalUp, UpCommand, metric

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def up(tiny_model_dir, tmp_path_factory):
    deployment = LocalUp(
        UpCommand(tiny_model_dir, tmp_path_factory.mktemp("tls-up"), scale={"decode": 1}, tls=True)
    )
    try:
        deployment.wait_whole(180)
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> Tls:
    return issue(tmp_path_factory.mktemp("stranger"))


def test_answers_match_hf_over_tls(up, hf_tiny, image_urls):
    client = client_for(up)
    for images in (0, 2):  # with images, the features cross an encoder's transfer port
        want_text, want_tokens = reference(hf_tiny, images, 16)
        answer = client.chat.completions.create(
            model="tiny-llava",
            messages=user_message(image_urls[:images], QUESTION),
            max_tokens=16,
            temperature=0,
        )
        assert answer.choices[0].message.content == want_text
        assert answer.usage.completion_tokens == want_tokens


def test_every_peer_port_reads_nothing_to_a_stranger(up, stranger):
    state = up.state()
    instances = up.cluster()
    assert instances and all(i["http_address"].startswith("https://") for i in instances)
    ports = {name: int(server["port"]) for name, server in state["servers"].items()}
    for inst in instances:
        name = inst["instance_id"]
        ports[f"{name} http"] = int(inst["http_address"].rpartition(":")[2])
        ports[f"{name} transfer"] = int(inst["transfer_address"].rpartition(":")[2])
    password = DeploymentSecrets.read(Path(state["secrets"])).redis_password
    # Each in its own tongue, credentials included where the protocol has them: a stranger who
    # stole the token and password still reads nothing without the certificate.
    asks = {
        "nats": b'CONNECT {"verbose":false}\r\nSUB > 1\r\nPING\r\n',
        "redis": f"AUTH {password}\r\nKEYS *\r\n".encode(),
    }
    for name, port in ports.items():
        ask = asks.get(name, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        for how, ctx in probes(stranger).items():
            assert only_alerts(probe("127.0.0.1", port, ctx, ask)), (name, how)
    # A member reads them: the workers' metrics over HTTPS, NATS with the certificate and token.
    tls = up.tls
    assert tls is not None
    assert all(metric(i["http_address"], "trident_engine_steps", tls) > 0 for i in instances)
    token = DeploymentSecrets.read(Path(state["secrets"])).nats_token

    async def member() -> None:
        nc = await nats.connect(f"nats://{token}@127.0.0.1:{ports['nats']}", **tls_options(tls))
        await nc.flush(timeout=5)
        await nc.close()

    asyncio.run(member())


def test_the_probe_command_shows_the_certificate(up):
    """Kubernetes probes a worker with `python -m services.worker.probe` (its httpGet cannot show a
    certificate): with the deployment's TLS folder it passes, without it it fails."""
    folder = str(up.tls.folder)
    for inst in up.cluster():
        port = inst["http_address"].rpartition(":")[2]
        env = {**os.environ, "TRIDENT_HTTP_PORT": port, "TRIDENT_TLS_DIR": folder}
        for path in ("/ready", "/health"):
            command = [sys.executable, "-m", "services.worker.probe", path]
            assert subprocess.run(command, env=env, timeout=30).returncode == 0, (inst["instance_id"], path)
        env.pop("TRIDENT_TLS_DIR")
        refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        assert refused.returncode == 1 and refused.stderr


def test_what_if_jobs_run_over_tls(up):
    """The planner queues a job in Redis and its Celery worker takes it and stores the result, all
    over TLS."""
    planner = up.state()["planner"]
    key = {"Authorization": f"Bearer {DeploymentSecrets.read(Path(up.state()['secrets'])).planner_key}"}
    job = {
        "workload": {"shape": "textcaps", "rate": 2.0, "num_requests": 20, "seed": 1},
        "slo": {"ttft": 0.5, "tbt": 0.1}, "instances": 3, "profiles": "paper:llava-1.5-7b",
    }  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # the planner starts beside the workers, maybe later
        try:
            reply = httpx.post(planner + "/plan/jobs", json=job, headers=key, timeout=30)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the planner never answered"
            time.sleep(0.5)
    assert reply.status_code == 202, reply.text
    url = f"{planner}/plan/jobs/{reply.json()['id']}"
    deadline = time.monotonic() + 120
    while (body := httpx.get(url, timeout=10).json())["state"] not in ("SUCCESS", "FAILURE"):
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    assert body["state"] == "SUCCESS", body["error"]
