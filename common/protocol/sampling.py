"""What a request asks of generation: one type for the gateway, the wire and the engine.

Its bounds are the engine's: a value the sampler cannot use fails here, when the request is made
or read off the wire, never in the middle of a step.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from common.protocol.codec import Record

# Integers the wire carries (msgpack: 64 bits) and the engine uses (token ids index a vocabulary).
INT32 = 2**31 - 1
INT64 = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32)]


class SamplingParams(Record):
    max_tokens: int = Field(16, ge=1, le=INT32)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # 0 means greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32)  # 0 means no top-k cut
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    # Structured output: an llguidance grammar (its JSON form, built by the gateway from
    # response_format or tools) that every sampled token must keep to; None: unconstrained.
    grammar: str | None = Field(None, min_length=1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
