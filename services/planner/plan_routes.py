"""The planner's own routes: health and metrics, the current plan and what it rests on, a forced
re-plan."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from common.errors import APIError
from common.planner.trace import trace_lines
from services.planner.access import PlannerDep, authorized
from services.planner.chart import goodput_chart
from services.planner.planner import NotPlanned, Planner

REPLAN_WAIT = 300.0  # seconds POST /plan/replan?wait=true waits for the plan

router = APIRouter()


@router.get("/health")
async def health(planner: PlannerDep) -> JSONResponse:
    problem = planner.unhealthy()  # a loop failed: the process is going down (common/runtime)
    body = {"status": problem or "ok", "planner": planner.status}
    return JSONResponse(body, status_code=500 if problem else 200)


@router.get("/ready")
async def ready(planner: PlannerDep) -> JSONResponse:
    ok = planner.bus.connected
    with contextlib.suppress(Exception):
        ok = ok and await planner.store.redis.ping()
    return JSONResponse({"ready": bool(ok)}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(planner: PlannerDep) -> Response:
    return Response(generate_latest(planner.metrics.registry), media_type="text/plain; version=0.0.4")


@router.get("/plan")
async def current_plan(planner: PlannerDep) -> dict:
    if planner.decision is None:
        raise APIError(404, f"no plan yet: {planner.status}", code="no_plan")
    capacity = planner.capacity.to_dict() if planner.capacity else None
    return {
        **planner.decision.to_dict(),
        "capacity": capacity,
        "status": planner.status,
        "progress": _progress(planner),
    }


@router.get("/plan/capacity")
async def capacity(planner: PlannerDep) -> dict:
    """The instances of each kind the forecast load needs (`desired`), and the forecast."""
    if planner.capacity is None:
        raise APIError(404, f"no capacity sized yet: {planner.status}", code="no_capacity")
    return planner.capacity.to_dict()


@router.get("/plan/chart.png")
async def current_chart(planner: PlannerDep) -> Response:
    if planner.decision is None:
        raise APIError(404, f"no plan yet: {planner.status}", code="no_plan")
    d = planner.decision
    png = await asyncio.to_thread(goodput_chart, d.result, f"plan {d.plan.decision_id} ({d.trigger})")
    return Response(png, media_type="image/png")


@router.get("/plan/trace")
async def planned_trace(planner: PlannerDep) -> Response:
    """The requests the planner plans for, as a trace file (docs/workloads.md) whose header carries
    the profiles, their calibration and the SLOs: `trident plan --trace` plans it as this service does."""
    try:
        entries, meta = await planner.export()
    except NotPlanned as exc:
        raise APIError(409, f"no trace to export yet: {exc}", code="not_plannable") from None
    if not entries:
        raise APIError(404, f"no finished requests yet: {planner.status}", code="no_requests")
    return Response("".join(trace_lines(entries, meta)), media_type="application/x-ndjson")


@router.post("/plan/replan", dependencies=[Depends(authorized)])
async def replan(planner: PlannerDep, wait: bool = False) -> JSONResponse:
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


def _progress(planner: Planner) -> dict | None:
    if planner.progress is None:
        return None
    fraction, message = planner.progress
    return {"fraction": fraction, "message": message}
