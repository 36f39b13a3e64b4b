"""The options of `trident bench serve` and `trident bench compare` that make a workload repeat
(trident/bench/repeat.py): one definition for both commands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Protocol

import typer

if TYPE_CHECKING:
    from trident.bench.repeat import Repeats

SystemTokens = Annotated[
    int, typer.Option(min=0, help="A shared system prompt of about this many tokens in every request.")
]
ImagePool = Annotated[
    int, typer.Option(min=0, help="Draw images from a pool of this many (0: every image distinct).")
]
PoolShare = Annotated[float, typer.Option(min=0.0, max=1.0, help="The share of images drawn from the pool.")]
Turns = Annotated[
    int, typer.Option(min=1, help="Turns per conversation; each resends the history (rates count turns).")
]
ThinkTime = Annotated[float, typer.Option(min=0.0, help="Mean seconds between an answer and the next turn.")]
ImageProb = Annotated[
    float, typer.Option(min=0.0, max=1.0, help="The chance that a turn after the first adds an image.")
]
ImageWindow = Annotated[
    int, typer.Option(min=0, help="Resend the images of this many latest turns only (0: all).")
]


class RepeatFlags(Protocol):
    """The flags above, as a command's parsed flags carry them (with its --seed)."""

    seed: int
    system_prompt_tokens: int
    image_pool: int
    pool_share: float
    turns: int
    think_time: float
    image_prob: float
    image_window: int


def repeats(flags: RepeatFlags) -> Repeats:
    from trident.bench.repeat import Repeats

    return Repeats(
        system_tokens=flags.system_prompt_tokens,
        image_pool=flags.image_pool,
        pool_share=flags.pool_share,
        turns=flags.turns,
        think_time=flags.think_time,
        image_prob=flags.image_prob,
        image_window=flags.image_window,
        seed=flags.seed,
    )
