"""Logits processors: the seam between the model's logits and the token chosen from them.

Each request's row of logits passes an ordered pipeline of processors, in place, before the
sampler (sampling.py) applies temperature, min_p, top-k and top-p and picks a token. A request
with nothing to process (the common case) skips the pipeline: its row goes to the sampler as the
model made it, and a greedy batch stays one argmax.

A processor is made for one request when the engine first samples it (`RequestSampler.build`),
by a factory in `PIPELINE` that returns None when the request does not need it. It keeps whatever
state it needs, but only as a cache of the request's tokens: each call reads the request's
`prompt_token_ids` and `output_token_ids` (the live lists) and catches up from where it last read.
So a request that moves between instances (the P→D hand-off, a replay after its decoder died, a
fork into n choices) rebuilds its state from the tokens it carries, and a processor never needs
telling that a token was chosen.

To add one (a grammar's token mask, say): write a class with `__call__(logits, req)` that changes
`logits` (a float32 row [vocab], on the model's device) in place, and a factory
`(params, eos_ids) -> processor | None`; put the factory in `PIPELINE` where it belongs — a mask
that must hold whatever else happens goes first — and give `SamplingParams` the field that asks
for it. Raw log-probabilities (`logprobs`) are taken before the pipeline, as vLLM's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.protocol.sampling import SamplingParams


class TokenHistory(Protocol):
    """What a processor reads of its request (the engine's Request is one)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, req: TokenHistory) -> None: ...


Factory = Callable[[SamplingParams, frozenset[int]], LogitsProcessor | None]


def _ids(tokens: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """Token ids as an index tensor on `device`, those past the row's width dropped (a vocabulary
    padded past the tokenizer's is the model's business; an id past the logits is nobody's)."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    return ids[ids < width].to(device)


@dataclass
class LogitBias:
    """OpenAI's `logit_bias`: each listed token's logit moves by its bias."""

    pairs: tuple[tuple[int, float], ...]
    _ids: torch.Tensor | None = None
    _bias: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, req: TokenHistory) -> None:
        if self._ids is None:
            kept = [(t, b) for t, b in self.pairs if t < logits.shape[-1]]
            self._ids = torch.as_tensor([t for t, _ in kept], dtype=torch.long).to(logits.device)
            self._bias = torch.as_tensor([b for _, b in kept], dtype=logits.dtype).to(logits.device)
        logits.index_add_(0, self._ids, self._bias)


@dataclass
class MinTokens:
    """No end before `min_tokens` outputs: eos and the stop token ids get -inf until then (as
    transformers' MinNewTokensLengthLogitsProcessor does for eos)."""

    min_tokens: int
    enders: tuple[int, ...]
    _ids: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, req: TokenHistory) -> None:
        if len(req.output_token_ids) >= self.min_tokens:
            return
        if self._ids is None:
            self._ids = _ids(self.enders, logits.shape[-1], logits.device)
        logits[self._ids] = float("-inf")


@dataclass
class Penalties:
    """`repetition_penalty` as transformers' RepetitionPenaltyLogitsProcessor (every token of the
    prompt and the output: a positive logit divided by it, a negative one multiplied), then
    OpenAI's `frequency_penalty` and `presence_penalty` over the output tokens alone (each token's
    logit less frequency × its count, less presence once if it occurs) — vLLM's order."""

    repetition: float
    frequency: float
    presence: float
    _seen: set[int] = field(default_factory=set)  # prompt and output tokens read so far
    _counts: dict[int, int] = field(default_factory=dict)  # output tokens read so far, counted
    _read: int = 0  # output tokens read
    _seen_ids: torch.Tensor | None = None  # `_seen` as an index, rebuilt when it grows

    def __call__(self, logits: torch.Tensor, req: TokenHistory) -> None:
        new = req.output_token_ids[self._read :]
        self._read = len(req.output_token_ids)
        for token in new:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self.repetition != 1.0:
            self._repeat(logits, req, new)
        if (self.frequency or self.presence) and self._counts:
            ids = _ids(self._counts, logits.shape[-1], logits.device)
            counts = torch.as_tensor([self._counts[t] for t in ids.tolist()], dtype=logits.dtype)
            counts = counts.to(logits.device)
            logits.index_add_(0, ids, -(self.frequency * counts + self.presence * (counts > 0)))

    def _repeat(self, logits: torch.Tensor, req: TokenHistory, new: list[int]) -> None:
        if self._seen_ids is None:  # first call: the prompt and every output so far
            self._seen.update(req.prompt_token_ids, req.output_token_ids)
            self._seen_ids = _ids(self._seen, logits.shape[-1], logits.device)
        else:
            fresh = [t for t in dict.fromkeys(new) if t not in self._seen]
            if fresh:
                self._seen.update(fresh)
                self._seen_ids = torch.cat([self._seen_ids, _ids(fresh, logits.shape[-1], logits.device)])
        picked = logits[self._seen_ids]
        logits[self._seen_ids] = torch.where(picked < 0, picked * self.repetition, picked / self.repetition)


def _logit_bias(params: SamplingParams, eos_ids: frozenset[int]) -> LogitsProcessor | None:
    return LogitBias(params.logit_bias) if params.logit_bias else None


def _min_tokens(params: SamplingParams, eos_ids: frozenset[int]) -> LogitsProcessor | None:
    if not params.min_tokens:
        return None
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    return MinTokens(params.min_tokens, tuple(sorted(enders))) if enders else None


def _penalties(params: SamplingParams, eos_ids: frozenset[int]) -> LogitsProcessor | None:
    p = params
    if p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty:
        return None
    return Penalties(p.repetition_penalty, p.frequency_penalty, p.presence_penalty)


# In the order applied. vLLM's: bias and min_tokens (which change which token may come at all),
# then the penalties; temperature, min_p, top-k and top-p follow in the sampler.
PIPELINE: tuple[Factory, ...] = (_logit_bias, _min_tokens, _penalties)


@dataclass
class RequestSampler:
    """One request's processors, made once; empty for a request that needs none."""

    params: SamplingParams
    processors: list[LogitsProcessor]

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: frozenset[int]) -> RequestSampler:
        made = (factory(params, eos_ids) for factory in PIPELINE)
        return cls(params, [p for p in made if p is not None])

    def process(self, logits: torch.Tensor, req: TokenHistory) -> None:
        """Run the pipeline over the request's row, in place."""
        for processor in self.processors:
            processor(logits, req)
