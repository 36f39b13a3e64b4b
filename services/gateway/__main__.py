"""`python -m services.gateway`: the OpenAI-compatible front door on TRIDENT_PORT."""

import logging
import sys

import uvicorn

from services.gateway.app import create_app
from services.settings import GatewaySettings

settings = GatewaySettings()
logging.basicConfig(
    level=settings.log_level.upper(),
    stream=sys.stderr,
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
)
print(f"gateway on http://{settings.bind_host}:{settings.port}", flush=True)
uvicorn.run(create_app(settings), host=settings.bind_host, port=settings.port, log_level="warning")
