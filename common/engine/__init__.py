"""A compact multimodal inference engine: vision encode, paged-KV prefill and decode, stage-level batching."""

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
