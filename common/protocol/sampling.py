"""What a request asks of generation: one type for the gateway, the wire and the engine.

Its bounds are the engine's: a value the sampler cannot use fails here, when the request is made
or read off the wire, never in the middle of a step. (A `logit_bias` id past the vocabulary is the
one exception: the vocabulary is the model's, so the gateway checks it, and the engine's admission.)
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from common.protocol.codec import Record

# Integers the wire carries (msgpack: 64 bits) and the engine uses (token ids index a vocabulary).
INT32 = 2**31 - 1
INT64 = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32)]
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (vLLM's default max_logprobs is 20 too)
MAX_CHOICES = 32  # n: each choice holds its own KV for its answer
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value


class SamplingParams(Record):
    max_tokens: int = Field(16, ge=1, le=INT32)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # 0 means greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32)  # 0 means no top-k cut
    # The first choice draws from `seed`; choice i of n from `choice_seed(seed, i)`.
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    # Choices drawn from one prompt: prefilled once, then forked (common/engine/forks.py).
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    # None: no log-probabilities; k: each output token's, and the k most likely at its position.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Added to the logits before anything else: (token id, bias) pairs, each id once.
    logit_bias: tuple[tuple[TokenId, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]], ...] = ()
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)  # OpenAI's
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)  # OpenAI's
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # HF's (and vLLM's)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=INT32)  # eos and stop_token_ids are masked until then

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @field_validator("logit_bias")
    @classmethod
    def _each_id_once(cls, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        if len({token for token, _ in pairs}) != len(pairs):
            raise ValueError("logit_bias names a token id twice")
        return pairs

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    def for_choice(self, index: int) -> SamplingParams:
        """What choice `index` of this request samples with: one choice, its own seed."""
        return self.model_copy(update={"n": 1, "seed": choice_seed(self.seed, index)})


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i's seed: seed + i (vLLM's rule), wrapped into the signed 64-bit range."""
    if seed is None or index == 0:
        return seed
    return (seed + index + 2**63) % 2**64 - 2**63


def choice_id(request_id: str, index: int) -> str:
    """The request id choice `index` runs under: the request's own for the first, and a suffix for
    the others, so each choice is an ordinary request from its fork on (its outputs, its journal,
    its resume after a failure)."""
    return request_id if index == 0 else f"{request_id}-n{index}"
