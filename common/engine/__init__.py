"""A compact multimodal inference engine: vision encode, paged-KV prefill and decode, stage-level batching.

The names below load on first use, so that reading `common.engine.config` (what a service's settings
need) does not import torch and transformers with the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.lazy import lazy_names

if TYPE_CHECKING:
    from common.engine.admission import AdmissionError
    from common.engine.config import EngineConfig, Policy
    from common.engine.engine import Engine
    from common.engine.outputs import Completion, RequestOutput
    from common.engine.sampling import SamplingParams

__all__ = [
    "AdmissionError",
    "Completion",
    "Engine",
    "EngineConfig",
    "Policy",
    "RequestOutput",
    "SamplingParams",
]


__getattr__ = lazy_names(
    __name__,
    {
        "AdmissionError": "common.engine.admission",
        "Completion": "common.engine.outputs",
        "Engine": "common.engine.engine",
        "EngineConfig": "common.engine.config",
        "Policy": "common.engine.config",
        "RequestOutput": "common.engine.outputs",
        "SamplingParams": "common.engine.sampling",
    },
)
