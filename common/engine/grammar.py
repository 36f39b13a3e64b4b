"""Structured output in the sampler: a request's grammar masks each of its logits rows to the tokens
that keep its output inside the grammar, and advances with each token sampled.

The grammar engine is llguidance (a Rust parser, one small wheel with no dependencies): the gateway
turns `response_format` or `tools` into an llguidance grammar, which travels in `SamplingParams`;
here it is compiled once per grammar text (a bounded LRU), and each request gets a copy of the
compiled matcher at its start state. A request's state is a function of the tokens it emitted, so
an instance that takes a request over (the decoder after prefill's first token, a replay after a
decoder died) rebuilds it by feeding those tokens through: `Grammars.state(grammar, emitted)`.

The narrow interface, per request: `mask(row)` a logits row in place, `advance(token)` after a
token is sampled, `done` once the grammar can take nothing more (the answer ends there, "stop").
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # loaded on the first grammar: an engine that serves none never maps the parser
    import llguidance

log = logging.getLogger(__name__)
CACHE_SIZE = 128  # compiled grammars kept; a schema's text is its key, so clients reusing one hit
ERROR_CHARS = 300  # of the parser's message, in an error a client reads
SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar that does not compile, or tokens it does not accept."""


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos = tuple(eos)

    @property
    def done(self) -> bool:
        """The output is complete: the grammar accepts it and no token can extend it."""
        return self.matcher.is_stopped()

    def allowed(self, width: int) -> torch.Tensor:
        """A bool [width] mask of the tokens that may come next. A matcher that failed (a parser
        limit hit mid-answer; never a client's input, which the gateway checked) allows only the
        end of the answer, so the request ends rather than leaves its grammar."""
        if self.matcher.is_error():
            log.warning("grammar matcher failed, the answer ends: %s", self.matcher.get_error()[:ERROR_CHARS])
            out = torch.zeros(width, dtype=torch.bool)
            out[[t for t in self.eos if t < width]] = True
            return out
        words = torch.from_numpy(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32).copy())
        bits = ((words.unsqueeze(1) >> SHIFTS) & 1).bool().view(-1)
        if bits.numel() >= width:
            return bits[:width]
        return torch.cat([bits, torch.zeros(width - bits.numel(), dtype=torch.bool)])

    def mask(self, row: torch.Tensor) -> None:
        """Set every logit the grammar forbids next to -inf, in place (`row` on any device)."""
        allowed = self.allowed(row.shape[-1]).to(row.device, non_blocking=True)
        row.masked_fill_(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        """The token sampled under this state's mask (so always accepted, barring a failed matcher)."""
        if not self.matcher.consume_token(token) and not self.matcher.is_error():
            raise GrammarError(f"token {token} is outside the grammar")


def mask_rows(logits: torch.Tensor, states: Iterable[GrammarState | None]) -> None:
    """Mask each row of `logits` [batch, vocab] whose request has a grammar (the sampler's one call)."""
    with torch.inference_mode():  # the forward's logits are inference tensors: changed in place here
        for i, state in enumerate(states):
            if state is not None:
                state.mask(logits[i])


class Grammars:
    """One tokenizer's compiled grammars. Thread-safe: the gateway checks grammars on several threads."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_ids: Iterable[int], capacity: int = CACHE_SIZE
    ) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.eos = sorted(eos_ids)
        self.capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s for 150k ids)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (a cache miss each)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None
                    )
                except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                    raise GrammarError(f"structured output needs a fast tokenizer here: {exc}") from exc
            return self._tokenizer

    def check(self, grammar: str) -> str | None:
        """Why `grammar` cannot be used (the parser's words, cut short), or None when it can."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return error[:ERROR_CHARS] if error else None

    def state(self, grammar: str, emitted: Sequence[int] = ()) -> GrammarState:
        """A fresh state for `grammar`, advanced through the tokens already `emitted` (a request
        taken over from another instance); GrammarError if it does not compile or they do not fit."""
        state = GrammarState(self._compiled_copy(grammar), self.eos)
        if emitted and not state.matcher.consume_tokens(list(emitted)):
            raise GrammarError(
                f"the {len(emitted)} tokens emitted so far do not fit the request's grammar: "
                f"{state.matcher.get_error()[:ERROR_CHARS]}"
            )
        return state

    def _compiled_copy(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher.deep_copy()
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()[:ERROR_CHARS]}")
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = matcher
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return matcher.deep_copy()
