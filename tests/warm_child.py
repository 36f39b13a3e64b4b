"""A stand-in service for tests/test_warm.py: says where it runs, then waits for SIGTERM, on which it
writes that it drained and exits 0 (an exit code from its environment, WARM_CHILD_EXIT, otherwise)."""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(os.environ["WARM_CHILD_OUT"])
stopped = []  # not a threading.Event: Event.set in a signal handler can deadlock Event.wait
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
print(f"child {os.getpid()} argv {sys.argv[1:]} env {os.environ.get('WARM_CHILD_MARK')}", flush=True)
(out / f"{os.getpid()}.started").write_text(str(os.getppid()))
if os.environ.get("WARM_CHILD_EXIT"):
    sys.exit(int(os.environ["WARM_CHILD_EXIT"]))
deadline = time.monotonic() + 120
while not stopped and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"{os.getpid()}.drained").write_text("")
