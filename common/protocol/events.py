"""Core-NATS messages: per-request outputs, control broadcasts, heartbeats and plan events."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from common.protocol.codec import Message, Record
from common.protocol.sampling import TokenId
from common.roles import Role

FinishReason = Literal["stop", "length", "abort"]
Method = Literal["e+p+d", "ep+d", "ed+p", "epd"]


# -- outputs: gateway ← prefill/decode, on the request's own subject ---------------------------------
class TokenLogprob(Record):
    """An output token's log-probability where it was sampled, and the most likely tokens there
    (best first, as many as the request's `logprobs` asked): log-softmax of the model's raw logits."""

    logprob: float
    top: tuple[tuple[TokenId, float], ...] = ()


class TokenDelta(Message):
    """New tokens of a request. `index` is the position of the first of them in the output.

    Prefill sends the first token and decode the rest over different connections, and NATS orders
    messages per publisher only, so the gateway uses `index` to put deltas back in order.
    """

    KIND: ClassVar[str] = "out.delta"
    VERSION: ClassVar[int] = 2  # v2: logprobs
    request_id: str
    index: int = Field(ge=0)
    token_ids: tuple[TokenId, ...] = Field(min_length=1)
    source: str = ""  # the instance that made them; the gateway ignores a fenced one's (failover)
    # One per token when the request asked for them (SamplingParams.logprobs), else none.
    logprobs: tuple[TokenLogprob, ...] = ()

    @model_validator(mode="after")
    def _one_each(self) -> TokenDelta:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError("a delta's logprobs are one per token, or none")
        return self


class Usage(Record):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(0, ge=0)  # of the prompt's, found in a prefix cache (not computed)


class FinalOutput(Message):
    """The end of a request: why it stopped and what it used. `num_outputs` counts every token sent
    in deltas, so the gateway knows when it has them all even if the final overtakes a delta."""

    KIND: ClassVar[str] = "out.final"
    VERSION: ClassVar[int] = 2  # v2: usage counts cached tokens
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    num_outputs: int = Field(ge=0)
    source: str = ""


class ErrorOutput(Message):
    """A request failed; `code` is an OpenAI-style error type the gateway maps to a status."""

    KIND: ClassVar[str] = "out.error"
    request_id: str
    code: str
    message: str
    source: str = ""


OUTPUT_KINDS: tuple[type[Message], ...] = (TokenDelta, FinalOutput, ErrorOutput)


# -- control: broadcasts ------------------------------------------------------------------------------
class Cancel(Message):
    """Stop a request everywhere and free what it holds (its client went away, or it failed)."""

    KIND: ClassVar[str] = "ctl.cancel"
    request_id: str
    reason: str = ""


class Fence(Message):
    """An instance was found dead (its heartbeats stopped): its work is handed to live replicas, and
    it must do nothing more — should it come back (it was only frozen), it leaves at once, and what
    it still sends is ignored."""

    KIND: ClassVar[str] = "ctl.fence"
    instance_id: str = Field(min_length=1)
    reason: str = ""


class Release(Message):
    """Decode has pulled a request's KV: the owner (a prefill instance) may free the blocks."""

    KIND: ClassVar[str] = "ctl.release"
    request_id: str
    owner: str
    handles: tuple[str, ...] = ()


class Resend(Message):
    """A gateway may have missed some of a request's outputs (a hole stayed open, the request fell
    silent, or its NATS connection came back): whoever holds the request, or ended it within its
    finals window, says its outputs again from `index`, and its final or error if it has one."""

    KIND: ClassVar[str] = "ctl.resend"
    request_id: str
    index: int = Field(0, ge=0)


# -- registry and planning -----------------------------------------------------------------------------
class Budgets(Record):
    """The stage-level batcher's per-iteration budgets (τe images, τt tokens)."""

    image_budget: int = Field(0, ge=0)
    token_budget: int = Field(0, ge=0)


class Heartbeat(Message):
    """An instance's liveness and load: a worker's is written to the registry with a TTL, and
    every instance's (gateways' too) is published, which is how a dead one is noticed within
    seconds. `held` lists the stream sequences of the tasks it holds, so they can be handed to a
    live replica at once; `leaving` says it ended cleanly (nothing to hand over)."""

    KIND: ClassVar[str] = "hb"
    # v2: kind, held and leaving; a gateway's has no roles. v3: prefix cache. v4: prefills_up_to.
    # v5: images_encoded, prefix_evictions
    VERSION: ClassVar[int] = 5
    instance_id: str = Field(min_length=1)
    kind: Literal["worker", "gateway"] = "worker"
    roles: tuple[Role, ...] = ()
    held: tuple[Annotated[int, Field(ge=0)], ...] = ()
    leaving: bool = False
    http_address: str = ""
    transfer_address: str = ""
    queue_depth: int = Field(0, ge=0)
    running: int = Field(0, ge=0)
    free_kv_blocks: int = Field(0, ge=0)
    total_kv_blocks: int = Field(0, ge=0)
    cached_kv_blocks: int = Field(0, ge=0)  # findable by their prefix key (free or held)
    prefix_queried_tokens: int = Field(0, ge=0)  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = Field(0, ge=0)  # of them, found cached
    prefix_evictions: int = Field(0, ge=0)  # cached blocks given up to an allocation, since start
    images_encoded: int = Field(0, ge=0)  # images its vision tower encoded, since start
    # A decode instance that also prefills a conversation's next turn sent to it, when at most this
    # many of its tokens are uncached there (TRIDENT_DECODE_PREFILL_TOKENS; 0: it does not).
    prefills_up_to: int = Field(0, ge=0)
    budgets: Budgets = Budgets()
    profile_id: str = ""
    draining: bool = False
    started_at: float = 0.0
    time: float  # wall clock when sent

    @model_validator(mode="after")
    def _worker_has_roles(self) -> Heartbeat:
        if self.kind == "worker" and not self.roles:
            raise ValueError("a worker's heartbeat names at least one role")
        return self


BlockKey = Annotated[bytes, Field(min_length=32, max_length=32)]  # a prefix-cache key (SHA-256)


class PrefixBlocks(Message):
    """Which prefix-cache keys an instance gained and gave up (a delta), or every key it holds (a
    snapshot, sent in `parts` messages of one `seq` when large). `seq` counts an instance's
    messages, so a reader sees a gap; snapshots, sent every few seconds, heal it and seed a reader
    that just started. Gateways index them to send a request where its prefix is cached."""

    KIND: ClassVar[str] = "kv.blocks"
    instance_id: str = Field(min_length=1)
    seq: int = Field(ge=0)
    block_size: int = Field(ge=1)
    snapshot: bool = False
    part: int = Field(0, ge=0)
    parts: int = Field(1, ge=1)
    gained: tuple[BlockKey, ...] = ()  # a snapshot lists its keys here
    dropped: tuple[BlockKey, ...] = ()

    @model_validator(mode="after")
    def _part_in_range(self) -> PrefixBlocks:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}")
        return self


class Plan(Message):
    """The planner's recommendation: which deployment method, and how many replicas per role kind."""

    KIND: ClassVar[str] = "plan"
    decision_id: int = Field(ge=1)
    method: Method
    replicas: dict[Annotated[str, Field(pattern="^(e|p|d|ep|ed|epd)$")], Annotated[int, Field(ge=0)]]
    time: float
    goodput: float | None = None
    reason: str = ""
