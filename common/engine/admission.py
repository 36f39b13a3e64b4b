"""How much new work an instance asks its task queues for: the pull-based admission rule the
workers run (services/worker) and the planner's simulator replays (common/planner)."""

from __future__ import annotations

from common.roles import Role

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
