"""The stages a worker can run, composed here, outside the worker runtime: each stage's handler
(services/<stage>/handler.py) builds on services/worker, and the worker imports none of them.
`python -m services.worker` (a hybrid's roles from TRIDENT_ROLES) runs with all of them; each
stage's own entry point (`python -m services.encoder`, ...) runs with its handler alone."""

from __future__ import annotations

from common.roles import Role
from services.decode.handler import DecodeHandler
from services.encoder.handler import EncodeHandler
from services.prefill.handler import PrefillHandler
from services.worker.instance import Stages
from services.worker.main import main as run_worker

# Each role's handler; a hybrid instance holds the handlers of all its roles.
STAGES: Stages = {Role.ENCODE: EncodeHandler, Role.PREFILL: PrefillHandler, Role.DECODE: DecodeHandler}


def main() -> None:
    """A worker whose roles come from `--roles` or TRIDENT_ROLES, any of the three stages."""
    run_worker(STAGES)
