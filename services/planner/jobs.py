"""What-if plans as Celery tasks: `python -m celery --app=services.planner.jobs worker --pool=solo`.

The planner's POST /plan/jobs validates a request, resolves its profiles, and queues `what_if` with a
self-contained JSON payload; the worker plans, reporting progress as state PROGRESS with
`{"progress": fraction, "message": ...}`, and returns the PlanResult with a PNG chart (base64).
Redis is broker and result backend (TRIDENT_PLANNER_JOBS_URL, default TRIDENT_REDIS_URL); every key
Celery writes is under `<namespace>:jobs:`, so deployments sharing a Redis do not share jobs.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from celery import Celery, Task
from celery.signals import worker_init

from common.store.connect import sentinel_target
from common.tls import Tls, redis_tls
from services.settings import PlannerSettings

TASK = "trident.planner.what_if"
RESULT_TTL = 24 * 3600  # seconds a finished job's result is kept


def celery_app(settings: PlannerSettings) -> Celery:
    url, options = celery_url(settings.planner_jobs_url or settings.redis_url, settings.tls)
    options["global_keyprefix"] = f"{settings.namespace}:jobs:"
    app = Celery("trident-planner", broker=url, backend=url)
    if settings.tls is not None:  # TLS to Redis (and its sentinels), with the deployment's certificate
        app.conf.update(
            broker_use_ssl=celery_tls(settings.tls), redis_backend_use_ssl=celery_tls(settings.tls)
        )
    app.conf.update(
        broker_transport_options=options,
        result_backend_transport_options=options,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=RESULT_TTL,
        task_track_started=True,
        # One plan at a time per worker, taken only when it is free.
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def celery_url(url: str, tls: Tls | None = None) -> tuple[str, dict[str, Any]]:
    """Celery's spelling of a Redis URL, and the transport options it needs: a redis+sentinel://
    URL (common/store/connect.py) becomes one sentinel:// URL per sentinel and the service's name
    (with `tls`, the sentinels are asked over TLS too)."""
    target = sentinel_target(url)
    if target is None:
        return url, {}
    auth = f":{quote(target.password, safe='')}@" if target.password else ""
    urls = ";".join(f"sentinel://{auth}{host}:{port}/{target.db}" for host, port in target.sentinels)
    sentinels = {"password": target.password, **redis_tls(tls, flag=True)}
    return urls, {"master_name": target.service, "sentinel_kwargs": sentinels}


def celery_tls(tls: Tls) -> dict[str, Any]:
    """Celery's and kombu's TLS settings for Redis (a redis:// URL stays as it is beside them)."""
    return {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": tls.ca,
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_check_hostname": False,
    }


app = celery_app(PlannerSettings())


@worker_init.connect
def _lower_priority(**_: Any) -> None:
    """What-if plans run beside the serving path on shared cores: they take what it leaves (set in
    the worker's main process before any pool starts, so every child inherits it)."""
    os.nice(PlannerSettings().planner_nice)


def run_what_if(
    request: dict[str, Any], progress: Callable[[float, str], None] | None = None
) -> dict[str, Any]:
    """Plan for a validated job payload (services/planner/job_models.py builds it)."""
    from common.planner.algorithm import plan
    from common.planner.capacity import recommend
    from common.planner.limits import Limits
    from common.planner.paper_profiles import profiles_from
    from common.planner.profiles import ProfileSet
    from common.planner.sizing import OutOfReach
    from common.planner.trace import TraceEntry, summary
    from common.planner.workloads import generate
    from common.stats import SLO
    from services.planner.chart import goodput_chart

    if request.get("trace") is not None:
        trace = [TraceEntry(**entry) for entry in request["trace"]]
    else:
        trace = generate(**request["workload"])
    spec = request["profiles"]
    profiles = profiles_from(spec) if isinstance(spec, str) else ProfileSet.from_dict(spec)
    slo = SLO(**request["slo"])
    instances, exhaustive, rate = request["instances"], request.get("exhaustive"), request.get("rate")
    sizing = None
    if rate is None:
        result = plan(trace, profiles, slo, instances, exhaustive=exhaustive, progress=progress)
    else:  # the fewest instances, up to `instances`, that serve the rate
        limits = Limits(max_instances=instances)
        capacity = recommend(trace, profiles, slo, rate, limits, exhaustive=exhaustive, progress=progress)
        if capacity.short:
            raise OutOfReach(capacity.short)
        sizing = capacity.sizing
        result, instances = sizing.result, sizing.instances
    png = goodput_chart(result, f"what-if: {len(trace)} requests on {instances} instances")
    body = {"plan": result.to_dict(), "trace": summary(trace), "chart_png": base64.b64encode(png).decode()}
    if sizing is not None:
        body["sizing"] = {
            k: v for k, v in sizing.to_dict().items() if k in ("rate", "recommended_instances", "tried")
        }
    return jsonable(body)


def jsonable(obj: Any) -> Any:
    """numpy scalars (and anything else json cannot write) as plain values, for Celery's JSON."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


class JobTimeLimit(RuntimeError):
    """A what-if job ran past TRIDENT_PLANNER_JOB_TIME_LIMIT; it ends FAILURE, saying so."""


def reporter(
    update: Callable[[float, str], None], limit: float, clock: Callable[[], float] = time.monotonic
) -> Callable[[float, str], None]:
    """The progress callback of a job: reports at most every 0.2 s (and at the end), and raises
    JobTimeLimit once the job has run `limit` seconds. The worker runs --pool=solo, where Celery
    enforces no time limit, so the job enforces its own at each candidate it simulates (and its
    inputs are bounded: job_models.py)."""
    deadline, last = clock() + limit, -1e9

    def progress(fraction: float, message: str) -> None:
        nonlocal last
        now = clock()
        if now > deadline:
            raise JobTimeLimit(f"the job ran over its {limit:g} s limit (TRIDENT_PLANNER_JOB_TIME_LIMIT)")
        if fraction >= 1.0 or now - last >= 0.2:  # a state write per simulated candidate is plenty
            last = now
            update(fraction, message)

    return progress


@app.task(bind=True, name=TASK)
def what_if(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    def update(fraction: float, message: str) -> None:
        self.update_state(state="PROGRESS", meta={"progress": round(fraction, 4), "message": message})

    update(0.0, "starting")
    return run_what_if(request, reporter(update, PlannerSettings().planner_job_time_limit))
