"""With TRIDENT_API_KEYS set, the planner's writes (a re-plan, a what-if job) ask for a key; its
reads do not. The check comes before anything else is done, so the app runs here unstarted."""

from __future__ import annotations

from fastapi.testclient import TestClient

from services.planner.app import create_app
from services.settings import PlannerSettings

KEY = {"Authorization": "Bearer k2"}


def client() -> TestClient:
    return TestClient(create_app(PlannerSettings(api_keys="k1, k2")), raise_server_exceptions=False)


def test_writes_without_a_key_are_401_with_an_openai_body():
    http = client()
    for path in ("/plan/replan", "/plan/jobs"):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            reply = http.post(path, json={}, headers=headers)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"


def test_a_write_with_a_key_goes_on_to_be_checked():
    reply = client().post("/plan/jobs", json={}, headers=KEY)  # past the key: the body is checked
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "slo"


def test_reads_need_no_key():
    assert client().get("/plan/jobs/nope").status_code != 401
