"""Stage tasks (JetStream): encode, prefill, decode.

Like vLLM's SchedulerOutput, a request's full data travels once to each stage that has not seen
it, and everything after carries ids and changes. Pixels ride only in the encode task; the
prefill task carries image hashes (features are looked up in the feature index and pulled from
their owner); the decode task carries the tokens so far and where the KV blocks are, not the KV.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from common.protocol.codec import Message, Record
from common.protocol.events import TokenLogprob
from common.protocol.sampling import SamplingParams, TokenId
from common.protocol.tensors import Dtype, InlineTensor, KvWire, Shape, TensorRef, int8_kv_nbytes
from common.roles import Role


class ImageSpec(Record):
    """One image of a request, identified by its content hash.

    `pixels` is the image itself: inline or by handle in encode tasks; in prefill tasks only by
    handle, as the source for recomputing features that can no longer be fetched. In
    prefill tasks `features` may carry the features (inline when small) or name where the encoder
    put them, which saves prefill a feature-index lookup; without it prefill looks the hash up.
    """

    content_hash: str = Field(min_length=1)
    num_tokens: int = Field(ge=1)
    pixels: InlineTensor | TensorRef | None = None
    features: InlineTensor | TensorRef | None = None
    # Qwen2-VL: the image's patch grid (t, h, w), which its M-RoPE positions follow; None for
    # families whose images are all one size.
    grid_thw: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    # LLaVA-NeXT: the picture's (height, width) before tiling, which its tiles are stitched back to.
    image_size: tuple[PositiveInt, PositiveInt] | None = None
    # Qwen-VL video: a clip (its placeholders are the video pad token), and the seconds of video
    # one temporal patch spans, which place its tokens in time (Qwen2.5-VL's M-RoPE).
    video: bool = False
    seconds_per_patch: PositiveFloat | None = None
    # In an encode task: the gateway found the image's KV in the cached prefix of the instance the
    # prefill goes to (`EncodeTask.prefill_to`), so an encoder that hands on passes it by, pixels
    # unpulled. The prefill instance checks its own cache and, if the prefix is gone, fetches the
    # features or sends the request back to encode as for any lost features.
    in_prefix: bool = False


TRACEPARENT = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"  # W3C trace context, version 00
TRACESTATE_MAX = 512  # characters W3C asks every hop to pass on; a longer one is dropped whole


class TraceContext(Record):
    """The W3C trace context of the request's span at the gateway (common/tracing.py): each stage
    opens its own span as that span's child."""

    traceparent: str = Field(pattern=TRACEPARENT)
    tracestate: str = Field("", max_length=TRACESTATE_MAX)

    def carrier(self) -> dict[str, str]:
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


class RequestSpec(Record):
    """Everything a stage needs to know about a request it has not seen before."""

    request_id: str = Field(min_length=1)
    prompt_token_ids: tuple[TokenId, ...]
    images: tuple[ImageSpec, ...] = ()
    sampling: SamplingParams = SamplingParams()
    arrival_time: float  # wall clock (time.time()) at the gateway
    # Tokens already generated and streamed, when the request resumes after the instance that
    # was generating it died: prefill computes them as context and generation continues after.
    output_token_ids: tuple[TokenId, ...] = ()
    # Their log-probabilities when the request asks for them: one per output token, None where not
    # known (tokens resumed from the gateway's journal: the gateway has them already); or none.
    output_logprobs: tuple[TokenLogprob | None, ...] = ()
    # The gateway whose client waits for it: should that gateway die, its requests are dropped.
    gateway: str = ""
    # Its trace (sent only when it has one: an untraced request's bytes are as before).
    trace: TraceContext | None = None

    def with_outputs(self, outputs: tuple[int, ...]) -> RequestSpec:
        """The same request resuming from `outputs`: the log-probabilities it knows are kept for
        the tokens it knew, None for those after (the gateway has them, it never asks again)."""
        known = (
            self.output_logprobs
            if self.output_token_ids == tuple(outputs[: len(self.output_token_ids)])
            else ()
        )
        logprobs = (*known[: len(outputs)], *[None] * (len(outputs) - len(known))) if known else ()
        return self.model_copy(update={"output_token_ids": tuple(outputs), "output_logprobs": logprobs})

    def without_pixels(self) -> RequestSpec:
        """The same request with pixels dropped: what travels on after encoding."""
        images = tuple(img.model_copy(update={"pixels": None}) for img in self.images)
        return self.model_copy(update={"images": images})


class StageTask(Message):
    """A request's next stage, queued on that stage's subject (`ROLE`); every kind carries the
    request itself, so any stage can send it on, or back, without asking anyone. (v2 of encode and
    prefill, v3 of decode: the request names its gateway; older payloads read as having none.)"""

    ROLE: ClassVar[Role]
    VERSION: ClassVar[int] = 3  # v3: the sampling fields of issue 48 (n, logprobs, penalties, ...)
    request: RequestSpec


class EncodeTask(StageTask):
    """Encode a request's images, then hand it to prefill. Carries the full request, pixels included."""

    KIND: ClassVar[str] = "task.encode"
    ROLE: ClassVar[Role] = Role.ENCODE
    VERSION: ClassVar[int] = 5  # v3: prefill_to; v4: images in_prefix; v5: the sampling fields (issue 48)
    # The prefill instance that holds the request's cached prefix, where the encoder sends the
    # prefill task (routing by cached prefix; empty: the shared queue).
    prefill_to: str = ""

    @model_validator(mode="after")
    def _has_pixels(self) -> EncodeTask:
        if not any(img.pixels is not None and not img.in_prefix for img in self.request.images):
            raise ValueError("an encode task needs at least one image with pixels to encode")
        return self


class PrefillTask(StageTask):
    """Prefill a request whose images are encoded (or that has none). Hashes and features; pixels
    only by reference, for recomputing lost features, never inline."""

    KIND: ClassVar[str] = "task.prefill"
    ROLE: ClassVar[Role] = Role.PREFILL

    @model_validator(mode="after")
    def _no_pixels(self) -> PrefillTask:
        if any(isinstance(img.pixels, InlineTensor) for img in self.request.images):
            raise ValueError("a prefill task carries pixels only by reference, never inline")
        return self


class KvGroup(Record):
    """One group of layers' KV as a single contiguous buffer [layers, 2, blocks, block_size, heads, dim]
    (`shape`); with the location's `wire` "int8", that buffer packed as common/engine/kv_quant.py says."""

    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    handle: str = ""  # empty when the buffer rides inline
    shape: Shape
    inline: InlineTensor | None = None  # a small buffer travels in the task itself: no pull

    @model_validator(mode="after")
    def _a_kv_buffer(self) -> KvGroup:
        if len(self.shape) != 6 or self.shape[1] != 2:
            raise ValueError(
                f"a KV group's shape is [layers, 2, blocks, block size, heads, dim], not {self.shape}"
            )
        if self.layer_end - self.layer_start != self.shape[0]:
            raise ValueError(
                f"layers {self.layer_start}-{self.layer_end} are not the {self.shape[0]} of its shape"
            )
        return self


class KvLocation(Record):
    """Where a prefilled request's KV lives: the owner serves one handle per group of layers."""

    owner: str
    address: str
    groups: tuple[KvGroup, ...] = Field(min_length=1)
    num_tokens: int = Field(ge=1)
    block_size: int = Field(ge=1)
    dtype: Dtype
    # M-RoPE (Qwen2-VL): every token after the prompt sits at its index plus this; 0 elsewhere.
    rope_delta: int = Field(0, ge=-(2**31), le=2**31)
    # NATIVE: each group's buffer in `dtype`; INT8: int8 values and per-block, per-head scales
    # (common/engine/kv_quant.py), turned back into `dtype` by the decoder.
    wire: KvWire = KvWire.NATIVE
    # Set when the KV streams while the prefill still runs (services/prefill/kv_stream.py): the
    # handle of the prefill's outcome, int64 [ended at prefill (0 | 1), *output token ids], served
    # once its step is over. The groups' handles are served as the forward finishes each.
    tail: str = ""

    def tail_ref(self, num_outputs: int) -> TensorRef:
        """The outcome's reference, for a request that comes with `num_outputs` tokens (one more
        is made in the prefill)."""
        return TensorRef(
            owner=self.owner, address=self.address, handle=self.tail, shape=(num_outputs + 2,), dtype="int64"
        )

    def refs(self) -> list[TensorRef]:
        """One pullable reference per layer group, in layer order, as the buffer travels."""
        return [
            TensorRef(owner=self.owner, address=self.address, handle=g.handle, **self.wire_form(g.shape))
            for g in self.groups
            if g.inline is None
        ]

    def wire_form(self, shape: tuple[int, ...]) -> dict:
        """The shape and dtype a group's buffer of `shape` travels as."""
        if self.wire == KvWire.INT8:
            return {"shape": (int8_kv_nbytes(shape),), "dtype": "uint8"}
        return {"shape": shape, "dtype": self.dtype}


class DecodeTask(StageTask):
    """Decode a request prefilled elsewhere: pull its KV, tell the owner to release it, generate.

    The request's `output_token_ids` are the tokens generated so far (the first token, or more
    when a decoder died and the request resumes); its images (hashes, pixels by reference) let
    decode send it back to prefill if the KV can no longer be had.
    """

    KIND: ClassVar[str] = "task.decode"
    # v1 spread the request's fields over the task itself; v4: cached_tokens; v5: kv.tail (streamed KV);
    # v6: the sampling fields of issue 48, and the request's output_logprobs
    VERSION: ClassVar[int] = 6
    ROLE: ClassVar[Role] = Role.DECODE
    kv: KvLocation
    cached_tokens: int = Field(0, ge=0)  # of the prompt's, the prefill found in its prefix cache

    @model_validator(mode="after")
    def _prefilled(self) -> DecodeTask:
        if not self.request.output_token_ids and not self.kv.tail:
            raise ValueError("a decode task's request needs its first output token (or its KV streamed)")
        if any(isinstance(img.pixels, InlineTensor) for img in self.request.images):
            raise ValueError("a decode task carries pixels only by reference, never inline")
        return self

    @classmethod
    def upgrade(cls, version: int, payload: dict[str, Any]) -> dict[str, Any]:
        if version == 1:
            kv = payload.pop("kv", None)
            return {"request": payload, "kv": kv}
        return payload
