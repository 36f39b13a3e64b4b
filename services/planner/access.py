"""What the planner's routes are given: the planner and its job queue (from the app's state), and
for writes, the key check."""

from __future__ import annotations

from typing import Annotated

from celery import Celery
from fastapi import Depends, Header, Request

from common.errors import APIError
from services.planner.planner import Planner
from services.settings import PlannerSettings


def _planner(request: Request) -> Planner:
    return request.app.state.planner


def _jobs(request: Request) -> Celery:
    return request.app.state.jobs


PlannerDep = Annotated[Planner, Depends(_planner)]
JobsDep = Annotated[Celery, Depends(_jobs)]


def authorized(request: Request, authorization: str = Header("")) -> None:
    """Writes (a re-plan, a job) ask for a key — one of TRIDENT_API_KEYS or the deployment's planner
    key — and with none configured are refused, unless TRIDENT_PLANNER_OPEN_WRITES opts out; reads
    ask for none."""
    settings: PlannerSettings = request.app.state.planner.settings
    keys = settings.write_keys
    if not keys:
        if settings.planner_open_writes:
            return
        raise APIError(
            401,
            "the planner's write endpoints need a key and none is configured: point "
            "TRIDENT_SECRETS_DIR at the deployment's secrets (its planner-key) or set "
            "TRIDENT_API_KEYS; TRIDENT_PLANNER_OPEN_WRITES=1 leaves them open",
            code="invalid_api_key",
        )
    if authorization.removeprefix("Bearer ").strip() not in keys:
        raise APIError(401, "missing or invalid API key", code="invalid_api_key")
