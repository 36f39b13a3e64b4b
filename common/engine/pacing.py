"""Keeping the TBT of requests that decode while a long prompt prefills beside them.

On an instance that decodes and prefills in one step (PD, EPD), every step that carries a prefill
chunk is a gap between two tokens of every request decoding there. τt holds such a step within the
TBT SLO; but a long prompt — a 2,000-token clip — then prefills in τt-sized chunks step after
step, and while it lasts every token of the text requests around it comes several times slower.

The pacer gives long prompts' chunks a share of the time instead: on average a step with decodes
takes at most `stretch` × a decode-only step. It keeps a credit in seconds. Each step with decodes
earns (stretch − 1) × a decode-only step; a step that carried long chunks spends what it took
beyond a decode-only step. Long chunks (each still within τt) go only into a step that starts with
credit left, so after a large chunk the decodes run alone until the time it took is earned back.
The credit never grows past one step's earning: time nobody used is not saved up into a burst of
chunks. A decode-only step's time is learnt from the steps the engine runs (the median of the last
few), and until one has been seen nothing is paced.

A clip's encode beside decodes (EPD, ED) is paced the same way: it is one encode, as long as its
frames make it, so it goes into a step with decodes only with credit left, and spends what it took.

Why whole τt chunks spaced out, not small chunks in every step: a chunk costs more than its tokens
— each one reads the prompt's whole KV so far, which at 2,000 tokens of context cost small-qwen2-vl
on one CPU thread as much as 50 decode-step milliseconds whatever the chunk's size — so chunks
small enough to keep every step within 1.5× a decode step could not be made, and the clip took
three times as long as it does in τt chunks (docs/benchmarks.md, "Fair to the text around it").
Spaced chunks cost no more in all than unpaced ones, and most text tokens (all but one in every
`1 + chunk time / earning` steps) come at decode-step pace.
"""

from __future__ import annotations

from collections import deque
from statistics import median

WINDOW = 16  # decode-only steps remembered


class Pacer:
    """The credit (module docstring): `allows` before a step, `observe` after it."""

    def __init__(self, stretch: float) -> None:
        if stretch <= 1.0:
            raise ValueError(f"stretch must be above 1, not {stretch}")
        self.stretch = stretch
        self.credit = 0.0  # seconds long work may still add to steps with decodes
        self._decode_steps: deque[float] = deque(maxlen=WINDOW)

    @property
    def decode_step(self) -> float | None:
        """A decode-only step's seconds, as lately seen (None: none seen yet)."""
        return median(self._decode_steps) if self._decode_steps else None

    def allows(self) -> bool:
        """Whether the next step with decodes may carry long work."""
        return self.credit >= 0.0

    def observe(self, decodes: int, seconds: float, *, decode_only: bool, paced: bool) -> None:
        """One step the engine ran: `decodes` one-token decodes, alone (`decode_only`) or beside
        other work, `paced` if that work held long prompts' chunks or clips' encodes, in `seconds`."""
        if decodes == 0:
            return
        if decode_only:
            self._decode_steps.append(seconds)
        step = self.decode_step
        if step is None:
            return
        earned = (self.stretch - 1.0) * step
        spent = max(0.0, seconds - step) if paced else 0.0
        self.credit = min(earned, self.credit + earned - spent)
