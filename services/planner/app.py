"""The planner's REST API: the current plan, forced re-plans, what-if jobs, health and metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from contextlib import asynccontextmanager
from typing import Any

from celery.result import AsyncResult
from fastapi import Depends, FastAPI, Header, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from common.errors import APIError, install_error_handlers
from common.planner.paper_profiles import profiles_from
from common.planner.profiles import ProfileError, ProfileSet
from common.planner.trace import trace_lines
from services.planner.chart import goodput_chart
from services.planner.job_models import JobRequest
from services.planner.jobs import RESULT_TTL, TASK, celery_app
from services.planner.planner import NotPlanned, Planner, load_profiles
from services.settings import PlannerSettings

REPLAN_WAIT = 300.0  # seconds POST /plan/replan?wait=true waits for the plan


def create_app(settings: PlannerSettings | None = None) -> FastAPI:
    settings = settings or PlannerSettings()
    planner = Planner(settings)
    jobs = celery_app(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await planner.start()  # its loop runs under the service runtime's supervision
        try:
            yield
        finally:
            await planner.close()

    app = FastAPI(title="Trident planner", lifespan=lifespan)
    app.state.planner = planner
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = planner.unhealthy()  # a loop failed: the process is going down (common/runtime)
        body = {"status": problem or "ok", "planner": planner.status}
        return JSONResponse(body, status_code=500 if problem else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = planner.bus.connected
        with contextlib.suppress(Exception):
            ok = ok and await planner.store.redis.ping()
        return JSONResponse({"ready": bool(ok)}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(planner.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/plan")
    async def current_plan() -> dict:
        if planner.decision is None:
            raise APIError(404, f"no plan yet: {planner.status}", code="no_plan")
        capacity = planner.capacity.to_dict() if planner.capacity else None
        return {
            **planner.decision.to_dict(), "capacity": capacity, "status": planner.status,
            "progress": _progress(planner),
        }  # fmt: skip

    @app.get("/plan/capacity")
    async def capacity() -> dict:
        """The instances of each kind the forecast load needs (`desired`), and the forecast."""
        if planner.capacity is None:
            raise APIError(404, f"no capacity sized yet: {planner.status}", code="no_capacity")
        return planner.capacity.to_dict()

    @app.get("/plan/chart.png")
    async def current_chart() -> Response:
        if planner.decision is None:
            raise APIError(404, f"no plan yet: {planner.status}", code="no_plan")
        d = planner.decision
        png = await asyncio.to_thread(goodput_chart, d.result, f"plan {d.plan.decision_id} ({d.trigger})")
        return Response(png, media_type="image/png")

    @app.get("/plan/trace")
    async def planned_trace() -> Response:
        """The requests the planner plans for, as a trace file (docs/workloads.md) whose header
        carries the profiles, their calibration and the SLOs: `trident plan --trace` plans it as
        this service does."""
        try:
            entries, meta = await planner.export()
        except NotPlanned as exc:
            raise APIError(409, f"no trace to export yet: {exc}", code="not_plannable") from None
        if not entries:
            raise APIError(404, f"no finished requests yet: {planner.status}", code="no_requests")
        return Response("".join(trace_lines(entries, meta)), media_type="application/x-ndjson")

    keys = settings.write_keys

    def authorized(authorization: str = Header("")) -> None:
        """Writes (a re-plan, a job) ask for a key — one of TRIDENT_API_KEYS or the deployment's
        planner key — and with none configured are refused, unless TRIDENT_PLANNER_OPEN_WRITES opts
        out; reads ask for none."""
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

    @app.post("/plan/replan", dependencies=[Depends(authorized)])
    async def replan(wait: bool = False) -> JSONResponse:
        """Re-plan now. Without `wait` the answer is 202 at once; GET /plan shows the new decision."""
        waiter = planner.request()
        if not wait:
            current = planner.decision.plan.decision_id if planner.decision else None
            return JSONResponse({"status": "requested", "decision_id": current}, status_code=202)
        try:
            decision = await asyncio.wait_for(waiter, REPLAN_WAIT)
        except NotPlanned as exc:
            raise APIError(409, f"cannot plan now: {exc}", code="not_plannable") from None
        except TimeoutError:
            raise APIError(504, f"no plan after {REPLAN_WAIT:.0f} s; see GET /plan later") from None
        return JSONResponse(decision.to_dict())

    # -- what-if jobs ----------------------------------------------------------------------------
    @app.post("/plan/jobs", status_code=202, dependencies=[Depends(authorized)])
    async def submit(body: JobRequest) -> dict:
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
        await planner.store.redis.set(
            planner.store.keys.plan_job(result.id), json.dumps(record), ex=RESULT_TTL
        )
        return {"id": result.id, "state": "PENDING", "url": f"/plan/jobs/{result.id}"}

    @app.get("/plan/jobs/{job_id}")
    async def job(job_id: str) -> dict:
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

    @app.get("/plan/jobs/{job_id}/chart.png")
    async def job_chart(job_id: str) -> Response:
        await _job_record(planner, job_id)
        state, info = await asyncio.to_thread(_job_state, jobs.AsyncResult(job_id))
        if state != "SUCCESS":
            raise APIError(404, f"job {job_id} has no chart: it is {state}", code="not_done")
        return Response(base64.b64decode(info["chart_png"]), media_type="image/png")

    return app


def _progress(planner: Planner) -> dict | None:
    if planner.progress is None:
        return None
    fraction, message = planner.progress
    return {"fraction": fraction, "message": message}


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
