"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, and a grammar's mask for
structured output (grammar.py); the parameters are `common.protocol.SamplingParams`, the one type
the gateway, the wire and the engine share."""

from __future__ import annotations

import hashlib

import torch

from common.engine.grammar import GrammarState, mask_rows
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    grammars: list[GrammarState | None] | None = None,
) -> list[int]:
    """Pick one token per row of `logits` [batch, vocab]. Greedy rows share one argmax. A row whose
    request has a grammar is masked first (in place), so whatever picks its token keeps to it."""
    if grammars is not None and any(g is not None for g in grammars):
        mask_rows(logits, grammars)
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_one(logits[i], p, generators[i])
    return tokens


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # On the CPU, so a seed gives the same tokens on any device; in float64 and from the largest
    # logit down, so any temperature the API admits is finite: near 0 the best token gets 0 and the
    # rest -inf (one-hot), where float32 made 0/0 = NaN of it, and a top_p below float32's smallest
    # number still keeps the first token.
    logits = logits.detach().to("cpu", torch.float64)
    logits = (logits - logits.max()) / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token is always kept.
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
