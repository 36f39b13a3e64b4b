"""Every message the services exchange, and every record they keep in Redis: typed and versioned.

Wire format: msgpack `[kind, version, payload]` (see codec.py). Use `msg.to_bytes()` and
`decode(data, expect=SomeKind)`; anything unreadable raises `ProtocolError`, never something else.
"""

from common.protocol.codec import Message, ProtocolError, Record, decode, encode, message_kinds
from common.protocol.events import (
    OUTPUT_KINDS,
    Budgets,
    Cancel,
    ErrorOutput,
    Fence,
    FinalOutput,
    FinishReason,
    Heartbeat,
    Method,
    Plan,
    PrefixBlocks,
    Release,
    Resend,
    TokenDelta,
    Usage,
)
from common.protocol.records import DeadLetter, FeatureEntry, StageProfile, StepStats, TraceRecord
from common.protocol.sampling import SamplingParams, TokenId
from common.protocol.tasks import (
    DecodeTask,
    EncodeTask,
    ImageSpec,
    KvGroup,
    KvLocation,
    PrefillTask,
    RequestSpec,
    StageTask,
    TraceContext,
)
from common.protocol.tensors import (
    DTYPE_SIZES,
    InlineTensor,
    KvWire,
    TensorRef,
    dtype_name,
    nbytes_of,
    torch_dtype,
)

__all__ = [
    "DTYPE_SIZES",
    "OUTPUT_KINDS",
    "Budgets",
    "Cancel",
    "DeadLetter",
    "DecodeTask",
    "EncodeTask",
    "ErrorOutput",
    "FeatureEntry",
    "Fence",
    "FinalOutput",
    "FinishReason",
    "Heartbeat",
    "ImageSpec",
    "InlineTensor",
    "KvGroup",
    "KvLocation",
    "KvWire",
    "Message",
    "Method",
    "Plan",
    "PrefillTask",
    "PrefixBlocks",
    "ProtocolError",
    "Record",
    "Release",
    "RequestSpec",
    "Resend",
    "SamplingParams",
    "StageProfile",
    "StageTask",
    "StepStats",
    "TensorRef",
    "TokenDelta",
    "TokenId",
    "TraceContext",
    "TraceRecord",
    "Usage",
    "decode",
    "dtype_name",
    "encode",
    "message_kinds",
    "nbytes_of",
    "torch_dtype",
]
