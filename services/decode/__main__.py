"""`python -m services.decode`: a stage worker with the decode role. It runs the decode stage's
handler alone, and the prefill stage's too when it continues conversations
(TRIDENT_DECODE_PREFILL_TOKENS: it then prefills the next turns sent to it; services/worker/instance.py)."""

from common.roles import Role
from services.stages import STAGES
from services.worker.main import main

main({role: STAGES[role] for role in (Role.DECODE, Role.PREFILL)}, roles="decode")
