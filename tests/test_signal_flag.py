"""SignalFlag (trident/launcher/signal_flag.py): set from a signal handler while the main thread waits.

With `threading.Event` in its place this script hangs within a few hundred tries (the handler waits on
the lock its own thread holds in `Event.wait`); `trident up` once ignored Ctrl-C that way in CI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from trident.launcher.signal_flag import SignalFlag

SCRIPT = textwrap.dedent(
    """
    import random, signal
    from trident.launcher.signal_flag import SignalFlag

    for _ in range(2000):
        flag = SignalFlag()
        signal.signal(signal.SIGALRM, lambda *_: flag.set())
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.002))
        while not flag.wait(0.0001):
            pass
    print("done")
    """
)


def test_wait_returns_once_set_or_timed_out() -> None:
    flag = SignalFlag()
    assert not flag.wait(0.01) and not flag.is_set()
    flag.set()
    assert flag.wait(10) and flag.is_set()


def test_a_signal_handler_sets_it_mid_wait() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
