"""The sampler: logits processors (logits.py), then a grammar's mask for structured output
(grammar.py), then greedy or temperature, min_p, top-k, top-p, with per-request seeds, and each
token's log-probabilities (the parameters are `common.protocol.SamplingParams`, the one type the
gateway, the wire and the engine share)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.grammar import GrammarState, mask_rows
from common.engine.logits import RequestSampler, TokenHistory
from common.protocol import TokenLogprob
from common.protocol.sampling import SamplingParams


def make_generator(seed: int | None, index: int = 0) -> torch.Generator | None:
    """The generator for a seeded request's `index`-th output token; None (unseeded) draws from the
    global RNG. A function of the seed and the position alone, so a request that moves between
    instances (the P→D hand-off, a resume after its decoder died) draws exactly what it would have
    drawn staying on one."""
    if seed is None:
        return None
    # torch's CPU generator keeps 32 bits of a seed: hash (seed, index) down to them.
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little"))
    return gen


@dataclass(frozen=True)
class Draw:
    """One row's token, and its log-probabilities when the request asked for them."""

    token: int
    logprob: TokenLogprob | None = None


def draw(
    logits: torch.Tensor,
    samplers: Sequence[RequestSampler],
    requests: Sequence[TokenHistory],
    grammars: Sequence[GrammarState | None] = (),
) -> list[Draw]:
    """A token for each row of `logits` [batch, vocab] (row i is `requests[i]`'s, sampled by
    `samplers[i]`, kept to `grammars[i]` when it has one): raw log-probabilities first, then each
    row's processors, then its grammar's mask (a mask holds whatever the processors did), then
    the choice. Rows whose requests need no processing are not copied, and greedy ones share one
    argmax."""
    want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    raw = logits[want].float().log_softmax(-1) if want else None
    masked = any(g is not None for g in grammars)
    if masked or any(s.processors for s in samplers):
        logits = logits.clone()  # the model's logits stay as they came (a CUDA graph's output buffer)
        for i, s in enumerate(samplers):
            s.process(logits[i], requests[i])
        if masked:
            mask_rows(logits, grammars)
    params = [s.params for s in samplers]
    gens = [
        None if p.greedy else make_generator(p.seed, len(r.output_token_ids))
        for p, r in zip(params, requests, strict=True)
    ]
    tokens = sample(logits, params, gens)
    found = _logprobs(raw, [tokens[i] for i in want], [params[i].logprobs for i in want]) if want else []
    by_row = dict(zip(want, found, strict=True))
    return [Draw(t, by_row.get(i)) for i, t in enumerate(tokens)]


def _logprobs(raw: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its `tops[i]` most likely: one top-k and one
    copy to the host for the batch."""
    k = max(tops)
    chosen = raw.gather(1, torch.as_tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
    if k:
        values, ids = raw.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for row, (lp, top) in enumerate(zip(chosen, tops, strict=True)):
        best = tuple(zip(ids[row][:top], values[row][:top], strict=True)) if top else ()
        out.append(TokenLogprob(logprob=lp, top=best))
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of `logits` [batch, vocab] (processed already). Greedy rows share one argmax."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_one(logits[i], p, generators[i])
    return tokens


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    probs = torch.softmax(warp(logits, p), dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the tokens, most likely first, whose mass reaches top_p (the first
    token always). Found among the k most likely, k growing until their mass reaches top_p: sorting
    a whole 32k vocabulary in float64 took 3.6 ms a row, most of a sampled step's sampling."""
    n, k = probs.numel(), min(64, probs.numel())
    while True:
        values, order = probs.topk(k)  # the first k of the sorted order
        # Summed in order, as the cut below and a full sort's cumsum sum them: with top_p near 1,
        # values.sum() (rounded otherwise) reached it where the cumsum did not, and kept too few.
        mass = values.cumsum(0)
        if k == n or mass[-1] >= top_p:  # the prefix ends among them: the rest are dropped
            drop = mass - values >= top_p
            drop[0] = False
            return torch.zeros_like(probs).scatter_(0, order, values.masked_fill(drop, 0.0))
        k = min(4 * k, n)


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """A row's logits as a sampled draw sees them: temperature, then min_p, then top-k (-inf where
    cut), in float64 on the CPU. On the CPU, so a seed gives the same tokens on any device; in
    float64 and from the largest logit down, so any temperature the API admits is finite: near 0
    the best token gets 0 and the rest -inf (one-hot), where float32 made 0/0 = NaN of it."""
    logits = logits.detach().to("cpu", torch.float64)
    logits = (logits - logits.max()) / p.temperature
    if p.min_p > 0.0:
        # transformers' MinPLogitsWarper (vLLM applies it here too, before top-k and top-p): drop
        # what is less likely than min_p times the best token; the best (logit 0 now) always stays.
        floor = torch.tensor(p.min_p, dtype=torch.float64).log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits
