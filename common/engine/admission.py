"""Admission: whether a request can ever run here, and how much new work an instance asks its
task queues for (the pull-based rule the workers run and the planner's simulator replays)."""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.errors import InputError


class AdmissionError(InputError):
    """A request this engine can never run (too long, wrong role); rejected before any work."""


def check_fits(
    prompt_tokens: int, max_tokens: int, *, max_model_len: int, kv_tokens: int | None = None
) -> None:
    """Raise AdmissionError for a request that can never run: its prompt and max_tokens together
    exceed the model's context, or the `kv_tokens` an instance's KV cache holds (when given). The
    gateway, the engine and a decode instance waiting for blocks all ask this."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise AdmissionError(
            f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the model's context "
            f"of {max_model_len} tokens; shorten the prompt or lower max_tokens"
        )
    if kv_tokens is not None and total > kv_tokens:
        raise AdmissionError(
            f"request needs {total} tokens of KV cache but this instance holds only {kv_tokens}"
        )


# Decode takes one request at a time while fewer than this many wait: each pull moves KV, and a
# request that waits holds blocks another replica could use.
DECODE_WAITING_LIMIT = 4
# Prefill keeps this many requests waiting, enough to fill the next iterations' token budget.
PREFILL_WAITING = 8


@dataclass(frozen=True)
class Load:
    """What a pull decision reads of an engine: a worker's engine stats, or the simulator's model
    of one."""

    waiting: int  # admitted, not yet scheduled (and, in the simulator, on their way)
    free_blocks: int
    image_budget: int  # τe
    running: int = 0
    token_budget: int = 0  # τt


# How many tasks a stage fetches now: what the batcher can take soon, no more. Each stage's
# handler names its rule (services/<stage>/handler.py `pull_rule`), and the planner's simulator
# replays the same functions.


def encode_room(load: Load) -> int:
    """Encode keeps two iterations' worth of images waiting."""
    return max(0, 2 * load.image_budget - load.waiting)


def prefill_room(load: Load) -> int:
    return max(0, PREFILL_WAITING - load.waiting)


def decode_room(load: Load) -> int:
    """One request at a time, while blocks are free and few wait. Decode also stops at
    `token_budget` requests in flight: every running decode is in every iteration, so more of them
    than τt would stretch each step past the TBT the budget was set for."""
    full = load.token_budget > 0 and load.running + load.waiting >= load.token_budget
    return 1 if load.free_blocks > 0 and load.waiting < DECODE_WAITING_LIMIT and not full else 0
