"""The OpenAI-compatible gateway's routes; a completion's way through is in serve.py."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from common.errors import Unavailable, install_error_handlers
from common.roles import Role
from services.gateway import serve
from services.gateway.api_models import ChatCompletionRequest, CompletionRequest
from services.gateway.door import Admission, ApiKeys, BodyReader, BodyRules
from services.gateway.request_context import RequestContext
from services.gateway.routing import live_roles
from services.gateway.state import Gateway
from services.settings import GatewaySettings

ADDRESSES_HIDDEN = (
    "hidden: the instances' http_address and transfer_address are shown to the deployment's planner key "
    "(Authorization: Bearer <planner-key>, from the secrets folder or TRIDENT_PLANNER_KEY)"
)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
router = APIRouter()


@router.get("/health")
async def health(gw: GatewayDep) -> JSONResponse:
    problem = gw.unhealthy()  # a loop failed: the process is going down (common/runtime)
    return JSONResponse({"status": problem or "ok"}, status_code=500 if problem else 200)


@router.get("/ready")
async def ready(gw: GatewayDep) -> JSONResponse:
    if problem := gw.unhealthy():
        return JSONResponse({"ready": False, "error": problem}, status_code=503)
    try:
        missing = sorted(set(Role) - live_roles(await gw.store.registry.instances()))
    except Exception as exc:
        return JSONResponse({"ready": False, "error": f"registry unreadable: {exc!r}"}, status_code=503)
    body = {"ready": not missing, "missing_roles": missing}
    return JSONResponse(body, status_code=200 if not missing else 503)


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(gw: GatewayDep) -> dict:
    card = {"id": gw.model_name, "object": "model", "created": 0, "owned_by": "trident"}
    return {"object": "list", "data": [card]}


@router.get("/v1/cluster")
async def cluster(gw: GatewayDep, request: Request) -> dict:
    try:
        instances = [hb.model_dump() for hb in await gw.store.registry.instances()]
        plan = await gw.store.planning.current_plan()
    except Exception as exc:
        raise Unavailable(f"the instance registry cannot be read ({type(exc).__name__})") from exc
    body: dict = {"instances": instances, "plan": plan.model_dump() if plan else None}
    if gw.settings.planner_key and not request.state.operator:  # the door checked the key
        # Where each instance listens is the operator's to know, not every API client's.
        for instance in instances:
            instance["http_address"] = instance["transfer_address"] = ""
        body["addresses"] = ADDRESSES_HIDDEN
    return body


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, gw: GatewayDep):
    return await serve.chat(gw, body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep):
    return await serve.completion(gw, body, request)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    gw = Gateway(settings or GatewaySettings())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await gw.start()
        yield
        await gw.close()

    app = FastAPI(title="Trident", lifespan=lifespan)
    app.state.gateway = gw
    install_error_handlers(app)
    # Outermost last: the request's id and trace, keys, then the whole body, then admission (door.py).
    app.add_middleware(
        Admission,
        limit=lambda: gw.settings.max_in_flight,
        full=gw.queue_full,
        on_change=gw.metrics.in_flight.set,
    )
    s = gw.settings
    rules = BodyRules(s.max_body_bytes, s.body_timeout_floor, s.body_timeout_per_mb)
    app.add_middleware(BodyReader, rules=rules)
    app.add_middleware(ApiKeys, keys=gw.api_keys, operator=gw.settings.planner_key)
    app.add_middleware(RequestContext, tracing=gw.tracing)
    app.include_router(router)
    return app
