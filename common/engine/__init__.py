"""A compact multimodal inference engine: vision encode, paged-KV prefill and decode, stage-level batching.

The names below load on first use, so that reading `common.engine.config` (what a service's settings
need) does not import torch and transformers with the engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.admission import AdmissionError
    from common.engine.config import EngineConfig, Policy
    from common.engine.engine import Engine
    from common.engine.outputs import Completion, RequestOutput
    from common.engine.sampling import SamplingParams

_HOMES = {
    "AdmissionError": "common.engine.admission",
    "Completion": "common.engine.outputs",
    "Engine": "common.engine.engine",
    "EngineConfig": "common.engine.config",
    "Policy": "common.engine.config",
    "RequestOutput": "common.engine.outputs",
    "SamplingParams": "common.engine.sampling",
}
__all__ = [
    "AdmissionError",
    "Completion",
    "Engine",
    "EngineConfig",
    "Policy",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
