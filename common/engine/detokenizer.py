"""Incremental detokenisation: text pieces whose concatenation equals decoding all ids at once.

Each step decodes a window — a few ids already in the text, as context, then the new ones — and
appends what the new ids add to the text, so a request costs time linear in its length, not
quadratic (a 2048-token answer took 326 ms of the gateway's event loop when every token decoded
the whole output again; 14 ms this way: bench/detokenizer.py). Should the context's own text
change when new ids follow it (a tokenizer that rewrites across tokens), the step falls back to
decoding everything.

A piece is released only when the text decoded so far is stable: it must not end in U+FFFD (a
UTF-8 character still missing bytes), and text that could be the start of a stop string is held
back until it is known not to be one. `flush()` at the end releases whatever is left.
"""

from __future__ import annotations

# Ids of decoded text in front of the new ones. Context keeps the window's text what a full decode
# gives: a SentencePiece decoder drops the leading space of a window's first token, and with
# context that token is an old one, whose text is not appended.
CONTEXT_IDS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # text decoded so far, cut before a stop string once one appears
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self._context = 0  # ids[_context:_read] are already text; they prefix the next window
        self._read = 0  # ids[:_read] are in `text`
        self._longest_stop = max(map(len, stop), default=0)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly releasable text (possibly empty)."""
        self.ids.extend(token_ids)
        if self.stopped:
            return ""
        if not self._advance(final=False):
            return ""  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        return self._release(len(self.text) - self._hold())

    def flush(self) -> str:
        """At the end of a request: release everything not yet handed out (stop strings excluded)."""
        if not self.stopped:
            self._advance(final=True)
        return self._release(len(self.text))

    def _advance(self, final: bool) -> bool:
        """Decode the ids not yet in `text` and append their text; False while it ends mid-character."""
        if self._read == len(self.ids):
            return True
        known = self._decode(self.ids[self._context : self._read])
        window = self._decode(self.ids[self._context :])
        if window.endswith("\ufffd") and not final:
            return False
        if window.startswith(known):
            searched_from = max(0, len(self.text) - self._longest_stop + 1)
            self.text += window[len(known) :]
        else:
            searched_from = 0
            self.text = self._decode(self.ids)
        self._read = len(self.ids)
        self._context = max(0, self._read - CONTEXT_IDS)
        self._cut_at_stop(searched_from)
        return True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _cut_at_stop(self, start: int) -> None:
        """Cut `text` before the earliest stop string that begins at or after `start`."""
        found = [at for s in self.stop if (at := self.text.find(s, start)) != -1]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _hold(self) -> int:
        """How many trailing characters of `text` may be the start of a stop string."""
        if self.stopped:
            return 0
        return max((_partial_suffix(self.text, s) for s in self.stop), default=0)

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
