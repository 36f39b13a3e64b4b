"""Incremental detokenisation: text pieces whose concatenation equals decoding all ids at once.

A piece is released only when the text decoded so far is stable: it must not end in U+FFFD (a
UTF-8 character still missing bytes), and text that could be the start of a stop string is held
back until it is known not to be one. `flush()` at the end releases whatever is left.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # text decoded so far, cut before a stop string once one appears
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly releasable text (possibly empty)."""
        self.ids.extend(token_ids)
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hold = self._update(full)
        if full.endswith("\ufffd") and not self.stopped:
            return ""  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        """At the end of a request: release everything not yet handed out (stop strings excluded)."""
        if not self.stopped:
            self._update(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        return self._release(len(self.text))

    def _update(self, full: str) -> int:
        """Set `text` from a full decode; return how many trailing characters may start a stop string."""
        self.text = full
        hold = 0
        for s in self.stop:
            at = full.find(s)
            if at != -1:
                self.text = full[:at]
                self.stopped = True
                return 0
            hold = max(hold, _partial_suffix(full, s))
        return hold

    def _release(self, end: int) -> str:
        piece = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
