"""What every service process runs on: its substrate clients and its supervised loops."""

from common.runtime.substrate import CLOSE_STEP_TIMEOUT, EXIT_LOOP_FAILED, Runtime, SubstrateSettings
from common.runtime.supervisor import FAULT_ENV, InjectedFault, LoopFailure, Supervisor

__all__ = [
    "CLOSE_STEP_TIMEOUT",
    "EXIT_LOOP_FAILED",
    "FAULT_ENV",
    "InjectedFault",
    "LoopFailure",
    "Runtime",
    "SubstrateSettings",
    "Supervisor",
]
