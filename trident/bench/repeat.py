"""Workloads that repeat, as real multimodal traffic does: a long system prompt every request shares,
images drawn again and again from a pool, and multi-turn chats that resend their history each turn.
These are what a prefix cache and a feature cache are for; without them a benchmark measures only
cold prompts (docs/benchmarks.md, "Workloads that repeat").

All of it is seeded: the same `Repeats` and seed give the same system prompt, pool, images, think
times and turns, so a run can be replayed against another server or with a cache switched off.
What varies between the rates of a sweep (`RequestOptions.seed`) is each request's own text and
images; the system prompt and the pool depend on `Repeats.seed` alone, so they stay shared across
the rates, as a deployment's would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

ImageSeed = int | tuple[int, ...]  # what seeds an image's pixels (client.image_data_url)

# Common short words, each one token in the usual vocabularies, so N words are about N tokens.
_SYSTEM_TEXT = (
    "you are a kind and fair aide who will look at each one of the images and say what is in it and "
    "where it is and how sure you are of it in a few short and clear lines for the user to read"
)


@dataclass(frozen=True)
class Repeats:
    """What a run's requests share. The defaults repeat nothing: every request is a cold prompt."""

    system_tokens: int = 0  # a system prompt of about this many tokens, the same in every request
    image_pool: int = 0  # images are drawn from a pool of this many (0: every image is distinct)
    pool_share: float = 0.8  # the share of images drawn from the pool; the rest are distinct
    turns: int = 1  # turns per conversation; over 1, each turn resends the history before it
    think_time: float = 0.0  # mean seconds (exponential) between an answer and the next turn
    image_prob: float = 0.0  # the chance that a turn after the first adds an image
    image_window: int = 0  # images are resent for this many latest turns only (0: all of them)
    seed: int = 0  # the system prompt, the pool and the conversations' draws depend on it

    def __post_init__(self) -> None:
        problems = []
        if self.system_tokens < 0 or self.image_pool < 0 or self.image_window < 0:
            problems.append("system prompt tokens, image pool and image window must be >= 0")
        if not 0.0 <= self.pool_share <= 1.0 or not 0.0 <= self.image_prob <= 1.0:
            problems.append("the pool share and the image probability are between 0 and 1")
        if self.turns < 1:
            problems.append(f"a conversation has at least one turn, got {self.turns}")
        if self.think_time < 0:
            problems.append(f"think time must be >= 0 s, got {self.think_time}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def multi_turn(self) -> bool:
        return self.turns > 1

    def system_prompt(self) -> str | None:
        """About `system_tokens` tokens (common short words are one token each), or None."""
        if not self.system_tokens:
            return None
        rng = np.random.default_rng([self.seed, 0x5E5])
        return " ".join(rng.choice(_SYSTEM_TEXT.split(), self.system_tokens))

    def image_seed(self, own: int, rng: np.random.Generator) -> ImageSeed:
        """The seed of the image to send where a request would send its own image `own`: one of the
        pool's (the same seed, so the same pixels, every time it is drawn) or `own` itself."""
        if self.image_pool and rng.random() < self.pool_share:
            return pool_image_seed(self.seed, int(rng.integers(self.image_pool)))
        return own

    def think(self, rng: np.random.Generator) -> float:
        return float(rng.exponential(self.think_time)) if self.think_time > 0 else 0.0

    def describe(self) -> dict:
        return asdict(self)


def pool_image_seed(seed: int, index: int) -> ImageSeed:
    """Pool images' seeds are triples, apart from requests' own (single numbers)."""
    return (0x9001, seed, index)


def conversation_rate(rate: float, repeats: Repeats) -> float:
    """Conversations per second that make `rate` turns per second (think time aside)."""
    return rate / repeats.turns
