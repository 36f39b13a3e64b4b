"""`python -m services.decode`: a stage worker with the decode role only."""

from common.roles import Role
from services.decode.handler import DecodeHandler
from services.worker.main import main

main({Role.DECODE: DecodeHandler}, roles="decode")
