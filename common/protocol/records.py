"""Records kept in Redis: feature-index entries, trace entries, stage profiles and dead letters.

They use the same envelope as bus messages, so a record written by one build and read by
another fails with a clear `ProtocolError` instead of being misread.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from pydantic import Field

from common.protocol.codec import Message
from common.protocol.tensors import TensorRef
from common.roles import Role, StepKind


class FeatureEntry(Message):
    """Feature-index entry (the MM store of 002 §3.2): who holds an image's features and how to pull them."""

    KIND: ClassVar[str] = "rec.feature"
    content_hash: str
    ref: TensorRef
    created: float

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes


class TraceRecord(Message):
    """One finished request, the planner's input: sizes, stage timestamps (wall clock) and outcome."""

    KIND: ClassVar[str] = "rec.trace"
    VERSION: ClassVar[int] = 2  # v2: encoded_images, cached_tokens
    request_id: str
    arrival: float
    prompt_tokens: int = Field(ge=0)
    image_tokens: int = Field(0, ge=0)
    num_images: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)
    # Work a cache spared: images whose features were stored already (the gateway skipped the
    # encoder for them), and prompt tokens the prefilling instance found in its prefix cache.
    encoded_images: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    finish_reason: str = ""
    stages: dict[str, float] = Field(default_factory=dict)
    # What the client saw, measured at the gateway; None when the gateway never reported (it died,
    # or the client left first). ttft counts from the HTTP request's arrival at the gateway; tbt_p90
    # is None with at most one output token (no gap to measure).
    ttft: float | None = Field(None, ge=0)
    tbt_p90: float | None = Field(None, ge=0)
    slo_met: bool | None = None


class StageProfile(Message):
    """What an instance measured about itself (the engine's StageProfile plus identity): budgets and
    latency curves in seconds, which the planner's simulator replays."""

    KIND: ClassVar[str] = "rec.profile"
    profile_id: str
    model: str = ""
    hardware: str = ""
    roles: tuple[Role, ...]
    latency_limit: float
    image_budget: int = Field(ge=0)
    token_budget: int = Field(ge=0)
    encode: tuple[tuple[int, float], ...] = ()  # (images, s)
    prefill: tuple[tuple[int, float], ...] = ()  # (tokens, s)
    decode: tuple[tuple[int, int, float], ...] = ()  # (batch, context, s)
    # Sizes a simulator needs to replay requests on this instance (0: not recorded).
    num_kv_blocks: int = Field(0, ge=0)
    block_size: int = Field(0, ge=0)
    kv_bytes_per_token: int = Field(0, ge=0)  # all layers, K and V, at the engine's dtype
    feature_bytes_per_image_token: int = Field(0, ge=0)  # one projected image token, as sent E→P
    max_num_seqs: int = Field(0, ge=0)
    max_model_len: int = Field(0, ge=0)
    # Tokens of the image the encode curve was measured on, where an image's cost follows its size
    # (LLaVA-NeXT, Qwen-VL): an image of k times as many costs k. 0: every image costs one.
    tokens_per_image: int = Field(0, ge=0)
    # The torch threads the curves were measured with (0: not recorded).
    threads: int = Field(0, ge=0)


class Step(NamedTuple):
    """One engine step as it ran in service. On the wire it is a plain array in this order, as the
    positional tuple it replaces was; a record from before threads and overlap were kept has the
    first six, and reads with their defaults (not known)."""

    kind: StepKind
    images: float  # in the profile's image units
    prefill_tokens: int
    decodes: int
    decode_context: float  # mean context of the decodes
    seconds: float
    threads: float = 0.0  # the torch threads it ran with (0: not known)
    overlap: float = -1.0  # other workers' steps on its host beside it, on average (-1: not known)


class StepStats(Message):
    """What an instance's engine steps took in service, lately (the planner calibrates its curves
    with them): one Step per step, and the budgets the governor has set."""

    KIND: ClassVar[str] = "rec.steps"
    instance_id: str
    roles: tuple[Role, ...]
    profile_id: str = ""
    time: float  # wall clock when published
    image_budget: int = Field(0, ge=0)
    token_budget: int = Field(0, ge=0)
    budget_scale: float = Field(1.0, gt=0)
    steps: tuple[Step, ...] = ()
    # Counters of the instance's host (services/worker/cpu_use.py), which the planner differences
    # between two reports: its cores' busy core-seconds (`host_cpu_seconds`) and this instance's
    # own CPU seconds (`process_cpu_seconds`); `host` tells hosts apart (the kernel's boot id,
    # "": not measured), `host_cores` the cores its workers' steps share (0: on a GPU).
    host: str = ""
    host_cores: int = Field(0, ge=0)
    host_cpu_seconds: float = Field(0.0, ge=0)
    process_cpu_seconds: float = Field(0.0, ge=0)


class DeadLetter(Message):
    """A task that will not be processed: malformed, failed on its last delivery, or out of deliveries."""

    KIND: ClassVar[str] = "rec.deadletter"
    stream: str
    subject: str
    stream_seq: int = Field(ge=0)
    deliveries: int = Field(ge=0)
    reason: str  # "malformed" | "failed" | "max_deliver"
    detail: str = ""
    consumer: str = ""
    data: bytes = b""  # the original message bytes, for inspection and replay
    time: float
