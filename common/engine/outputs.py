"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import TokenLogprob
from common.roles import Role


@dataclass
class RequestOutput:
    """The change one step made to a request: new tokens, the text they complete, and how it ended."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The stage the request needs next, when another instance runs it: the request left this one
    # (its KV, if any, stays until the next stage has pulled it).
    next_stage: Role | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt's, found in the prefix cache (Request.num_cached_tokens)
    # One per new token when the request asked for them (SamplingParams.logprobs).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set on a choice's first output when it was forked from `forked_from` (forks.py): a new request
    # here, choice `choice` of that one's n.
    forked_from: str | None = None
    choice: int = 0


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for
