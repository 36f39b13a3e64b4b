"""`python -m services.planner`: the planner's REST API on TRIDENT_HTTP_PORT (default 8100)."""

import logging
import os
import sys

import uvicorn

from services.planner.app import create_app
from services.settings import PlannerSettings

settings = PlannerSettings()
os.nice(settings.planner_nice)  # before any thread starts: every thread of the process inherits it
logging.basicConfig(
    level=settings.log_level.upper(),
    stream=sys.stderr,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
)
print(f"planner on http://{settings.bind_host}:{settings.http_port}", flush=True)
uvicorn.run(create_app(settings), host=settings.bind_host, port=settings.http_port, log_level="warning")
