"""`python -m services.encoder`: a stage worker with the encode role only."""

from common.roles import Role
from services.encoder.handler import EncodeHandler
from services.worker.main import main

main({Role.ENCODE: EncodeHandler}, roles="encode")
