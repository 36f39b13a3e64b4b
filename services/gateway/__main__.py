"""`python -m services.gateway`: the OpenAI-compatible front door on TRIDENT_PORT."""

import logging
import sys

from services.gateway.app import create_app
from services.gateway.request_context import RequestIdFilter
from services.gateway.server import serve
from services.settings import GatewaySettings

settings = GatewaySettings()
logging.basicConfig(
    level=settings.log_level.upper(),
    stream=sys.stderr,
    format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s",
)
for handler in logging.getLogger().handlers:  # each line names the request it was written for
    handler.addFilter(RequestIdFilter())
print(f"gateway on http://{settings.bind_host}:{settings.port}", flush=True)
serve(create_app(settings), settings)
