"""The planner's REST API: the current plan, forced re-plans, what-if jobs, health and metrics
(the routes in plan_routes.py and job_routes.py)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from common.errors import install_error_handlers
from services.planner import job_routes, plan_routes
from services.planner.jobs import celery_app
from services.planner.planner import Planner
from services.settings import PlannerSettings


def create_app(settings: PlannerSettings | None = None) -> FastAPI:
    planner = Planner(settings or PlannerSettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await planner.start()  # its loop runs under the service runtime's supervision
        try:
            yield
        finally:
            await planner.close()

    app = FastAPI(title="Trident planner", lifespan=lifespan)
    app.state.planner = planner
    app.state.jobs = celery_app(planner.settings)
    install_error_handlers(app)
    app.include_router(plan_routes.router)
    app.include_router(job_routes.router)
    return app
