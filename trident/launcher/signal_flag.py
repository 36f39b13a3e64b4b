"""A stop flag that a signal handler may set.

`threading.Event.set()` takes the Event's lock. A Python signal handler runs in the main thread,
between two bytecodes of whatever it interrupted, so if the main thread is inside `Event.wait()`
and holds that lock at that moment (entering or leaving the wait), the handler waits on a lock
its own thread holds, forever: `trident up` then ignored Ctrl-C and `trident down` alike. This flag
takes no lock; its wait polls in short sleeps, which signals shorten.
"""

from __future__ import annotations

import time

POLL = 0.05  # seconds between looks at the flag while waiting


class SignalFlag:
    """Set from anywhere, a signal handler included; read and waited on from the main thread."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True  # one store: atomic under the interpreter, and no lock

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether the flag is set, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, POLL))
        return self._set
