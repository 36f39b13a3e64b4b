"""`python -m services.prefill`: a stage worker with the prefill role only."""

from common.roles import Role
from services.prefill.handler import PrefillHandler
from services.worker.main import main

main({Role.PREFILL: PrefillHandler}, roles="prefill")
