"""Admission: whether a request can ever run here, and how much new work an instance asks its
task queues for (the pull-based rule the workers run and the planner's simulator replays)."""

from __future__ import annotations

from common.engine.processor import InputError
from common.roles import Role


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


def pull_room(
    role: Role, *, waiting: int, free_blocks: int, image_budget: int, running: int = 0, token_budget: int = 0
) -> int:
    """How many tasks of `role` to fetch now: what the batcher can take soon, no more.

    Decode also stops at `token_budget` requests in flight: every running decode is in every
    iteration, so more of them than τt would stretch each step past the TBT the budget was set for.
    """
    if role == Role.DECODE:
        full = token_budget > 0 and running + waiting >= token_budget
        return 1 if free_blocks > 0 and waiting < DECODE_WAITING_LIMIT and not full else 0
    if role == Role.ENCODE:
        return max(0, 2 * image_budget - waiting)
    return max(0, PREFILL_WAITING - waiting)
