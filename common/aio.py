"""Long-running loops that end when cancelled, even when a library swallowed the cancel.

On Python 3.11, `asyncio.wait_for` returns its result and drops a cancel that lands in the same
loop turn as the result (fixed in 3.12). redis-py and nats-py await `wait_for` inside their calls,
so a task cancelled while one of them completes carries on as if never cancelled: a loop then runs
on, and the task group that cancelled it waits forever (a worker that never exits after its drain).
The task still counts the request (`Task.cancelling()`), so every such loop asks at each turn.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop, even if the cancel itself was lost."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
