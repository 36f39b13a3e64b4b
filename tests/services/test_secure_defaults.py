"""`trident up` is closed by default: NATS asks for the deployment's token, Redis for its password,
every transfer port for its secret, and the planner's writes for its key. A client without them
reads no output subject, writes no plan, pulls nothing and re-plans nothing; with them (what the
services get, TRIDENT_SECRETS_DIR) it does."""

from __future__ import annotations

import asyncio
import contextlib
import stat
import time
from pathlib import Path

import httpx
import nats
import pytest
import redis

from common.secrets import NAMES, DeploymentSecrets
from common.store.keys import Keys
from common.transfer import TransferConfig, create_backend
from common.transfer.errors import Forbidden, HandleNotFound
from tests.helpers.chat import client_for, user_message
from trident.launcher.local_up import LocalUp, UpCommand

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def up(tiny_model_dir, tmp_path_factory):
    deployment = LocalUp(UpCommand(tiny_model_dir, tmp_path_factory.mktemp("secure"), scale={"decode": 1}))
    try:
        deployment.wait_whole(180)
        yield deployment
    finally:
        deployment.stop()


def secrets_of(up: LocalUp) -> DeploymentSecrets:
    return DeploymentSecrets.read(Path(up.state()["secrets"]))


def test_the_secrets_are_made_for_the_deployment_and_readable_by_its_owner_only(up):
    folder = Path(up.state()["secrets"])
    for name in NAMES:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    found = secrets_of(up)
    assert len({found.nats_token, found.redis_password, found.transfer_secret}) == 3
    answer = client_for(up).chat.completions.create(
        model="tiny-llava", max_tokens=3, messages=user_message([], "hello")
    )
    assert answer.usage.completion_tokens == 3  # the services themselves have what they need


def test_nats_refuses_a_client_without_the_token(up):
    address = up.state()["servers"]["nats"]["url"]

    async def subscribe(url: str) -> None:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
        try:
            await nc.subscribe("trident.out.>")
            await nc.flush(timeout=2)
        finally:
            await nc.close()

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(subscribe(address))
    token = secrets_of(up).nats_token
    asyncio.run(subscribe(address.replace("nats://", f"nats://{token}@")))  # with it: allowed


def test_redis_refuses_a_plan_written_without_the_password(up):
    url = up.state()["servers"]["redis"]["url"]
    plan_key = Keys("trident").plan_apply
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=2).set(plan_key, b"x")
    with redis.Redis.from_url(url, password=secrets_of(up).redis_password) as client:
        assert client.exists(plan_key) == 0  # nothing was written
        assert client.ping()


def test_a_transfer_port_answers_only_with_the_secret(up):
    (decoder,) = up.instances("decode")
    address = decoder["transfer_address"]

    async def pull(secret: str) -> Exception:
        puller = create_backend(TransferConfig(timeout=10, secret=secret))
        await puller.start()
        try:
            await puller.pull(address, "no-such-handle")
        except Exception as exc:
            return exc
        finally:
            await puller.close()
        raise AssertionError("a pull of a handle nobody published succeeded")

    assert isinstance(asyncio.run(pull("")), Forbidden)
    assert isinstance(asyncio.run(pull("wrong")), Forbidden)
    # With the secret the owner looks the handle up: the refusal was the secret's, not the handle's.
    assert isinstance(asyncio.run(pull(secrets_of(up).transfer_secret)), HandleNotFound)


def test_the_planners_writes_take_the_deployments_planner_key(up):
    """Regression: with keys off (the default), POST /plan/replan and /plan/jobs answered 202 to anyone."""
    planner = up.state()["planner"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the planner starts beside the workers, maybe later
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(planner + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.5)
    for path in ("/plan/replan", "/plan/jobs"):
        refused = httpx.post(planner + path, json={}, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
    key = {"Authorization": f"Bearer {secrets_of(up).planner_key}"}
    assert httpx.post(planner + "/plan/replan", headers=key, timeout=10).status_code == 202


def test_the_cluster_view_shows_where_instances_listen_to_the_operator_only(up):
    """Regression: GET /v1/cluster listed every instance's HTTP and transfer address to anyone who
    reached the gateway. They are shown under the deployment's planner key, blank to others."""
    anyone = httpx.get(up.url + "/v1/cluster", timeout=5).json()
    assert anyone["instances"] and "planner key" in anyone["addresses"]
    assert all(i["http_address"] == i["transfer_address"] == "" for i in anyone["instances"])
    assert all(i["instance_id"] and i["roles"] for i in anyone["instances"])  # the rest stays
    wrong = httpx.get(up.url + "/v1/cluster", headers={"Authorization": "Bearer nope"}, timeout=5).json()
    assert all(i["http_address"] == "" for i in wrong["instances"])
    operator = up.cluster()  # under the planner key
    assert all(i["http_address"].startswith("http://127.0.0.1:") for i in operator)
    assert all(i["transfer_address"] for i in operator)
