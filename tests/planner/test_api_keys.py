"""The planner's writes (a re-plan, a what-if job) ask for a key by default: one of
TRIDENT_API_KEYS or the deployment's planner key (TRIDENT_SECRETS_DIR); with none configured they
are refused unless TRIDENT_PLANNER_OPEN_WRITES opts out. Its reads ask for none. The check comes
before anything else is done, so the app runs here unstarted."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from common.secrets import DeploymentSecrets
from services.planner.app import create_app
from services.settings import PlannerSettings

KEY = {"Authorization": "Bearer k2"}
WRITES = ("/plan/replan", "/plan/jobs")


def client(**settings) -> TestClient:
    return TestClient(create_app(PlannerSettings(**settings)), raise_server_exceptions=False)


def test_writes_without_a_key_are_401_with_an_openai_body():
    http = client(api_keys="k1, k2")
    for path in WRITES:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            reply = http.post(path, json={}, headers=headers)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"


def test_a_write_with_a_key_goes_on_to_be_checked():
    reply = client(api_keys="k1, k2").post("/plan/jobs", json={}, headers=KEY)  # past the key: the body
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "slo"


def test_with_no_key_configured_writes_are_refused_by_default():
    """Regression: with keys off (the default), POST /plan/replan and /plan/jobs answered 202 to anyone."""
    http = client()
    for path in WRITES:
        reply = http.post(path, json={})
        assert reply.status_code == 401, (path, reply.text)
        assert "TRIDENT_PLANNER_OPEN_WRITES" in reply.json()["error"]["message"]


def test_the_deployment_secrets_give_the_planner_its_key(tmp_path: Path):
    secrets = DeploymentSecrets.ensure(tmp_path / "secrets")
    assert secrets.planner_key and (tmp_path / "secrets" / "planner-key").stat().st_mode & 0o077 == 0
    http = client(secrets_dir=tmp_path / "secrets", api_keys="k1")
    assert http.post("/plan/jobs", json={}).status_code == 401
    right = {"Authorization": f"Bearer {secrets.planner_key}"}
    assert http.post("/plan/jobs", json={}, headers=right).status_code == 400  # past the key
    assert http.post("/plan/jobs", json={}, headers={"Authorization": "Bearer k1"}).status_code == 400


def test_the_opt_out_leaves_writes_open():
    reply = client(planner_open_writes=True).post("/plan/jobs", json={})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "slo"


def test_reads_need_no_key():
    assert client(api_keys="k1").get("/plan/jobs/nope").status_code != 401
    assert client().get("/plan/jobs/nope").status_code != 401
