"""The planner's what-if jobs over REST: submitted to Celery (services/planner/jobs.py), their state
and result, and a finished one's chart."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from celery.result import AsyncResult
from fastapi import APIRouter, Depends, Response

from common.errors import APIError
from common.planner.paper_profiles import profiles_from
from common.planner.profiles import ProfileError, ProfileSet
from services.planner.access import JobsDep, PlannerDep, authorized
from services.planner.job_models import JobRequest
from services.planner.jobs import RESULT_TTL, TASK
from services.planner.planner import Planner, load_profiles

router = APIRouter()


@router.post("/plan/jobs", status_code=202, dependencies=[Depends(authorized)])
async def submit(body: JobRequest, planner: PlannerDep, jobs: JobsDep) -> dict:
    try:
        entries = body.entries()
    except ValueError as exc:
        raise APIError(400, str(exc), param="trace") from None
    if (entries is None) == (body.workload is None):
        raise APIError(400, "give exactly one of `trace` and `workload`", param="trace")
    profiles = await _resolve_profiles(planner, body.profiles)
    payload = body.payload(entries, profiles)
    result = await asyncio.to_thread(jobs.send_task, TASK, args=[payload])
    requests = len(entries) if entries is not None else body.workload.num_requests  # type: ignore[union-attr]
    record = {"submitted": time.time(), "requests": requests, "instances": body.instances}
    await planner.store.redis.set(planner.store.keys.plan_job(result.id), json.dumps(record), ex=RESULT_TTL)
    return {"id": result.id, "state": "PENDING", "url": f"/plan/jobs/{result.id}"}


@router.get("/plan/jobs/{job_id}")
async def job(job_id: str, planner: PlannerDep, jobs: JobsDep) -> dict:
    record = await _job_record(planner, job_id)
    state, info = await asyncio.to_thread(_job_state, jobs.AsyncResult(job_id))
    body: dict[str, Any] = {"id": job_id, "state": state, **record}
    body.update(progress=0.0, message=state.lower(), result=None, error=None)
    if state == "PROGRESS" and isinstance(info, dict):
        body.update(progress=info.get("progress", 0.0), message=info.get("message", ""))
    elif state == "SUCCESS":
        body.update(progress=1.0, message="done", chart=f"/plan/jobs/{job_id}/chart.png")
        body["result"] = {k: v for k, v in info.items() if k != "chart_png"}
    elif state == "FAILURE":
        body["error"] = f"{type(info).__name__}: {info}"
    return body


@router.get("/plan/jobs/{job_id}/chart.png")
async def job_chart(job_id: str, planner: PlannerDep, jobs: JobsDep) -> Response:
    await _job_record(planner, job_id)
    state, info = await asyncio.to_thread(_job_state, jobs.AsyncResult(job_id))
    if state != "SUCCESS":
        raise APIError(404, f"job {job_id} has no chart: it is {state}", code="not_done")
    return Response(base64.b64decode(info["chart_png"]), media_type="image/png")


async def _resolve_profiles(planner: Planner, spec: str | dict) -> str | dict:
    """Check the profiles a job names, and inline the cluster's, so the task has nothing to look up."""
    try:
        if spec == "cluster":
            published = await planner.store.planning.profiles()
            if not published:
                raise ProfileError(
                    "no instance has published a stage profile; name paper:llava-1.5-7b or give profiles"
                )
            return load_profiles("cluster", published, planner.window).to_dict()
        if isinstance(spec, str):
            if not spec.startswith("paper:"):
                raise ProfileError('expected "cluster", "paper:<model>" or a profile set object')
            profiles_from(spec)
            return spec
        return ProfileSet.from_dict(spec).to_dict()
    except (ProfileError, TypeError, ValueError) as exc:
        raise APIError(400, f"profiles: {exc}", param="profiles") from None


async def _job_record(planner: Planner, job_id: str) -> dict:
    raw = await planner.store.redis.get(planner.store.keys.plan_job(job_id))
    if raw is None:
        raise APIError(404, f"no job {job_id!r} (or its result has expired)", param="job_id")
    return json.loads(raw)


def _job_state(result: AsyncResult) -> tuple[str, Any]:
    """State and info in one place (two reads of a running job could disagree)."""
    meta = result.backend.get_task_meta(result.id)
    state = meta.get("status", "PENDING")
    info = meta.get("result")
    if state == "FAILURE":
        info = result.backend.exception_to_python(info)
    return state, info
