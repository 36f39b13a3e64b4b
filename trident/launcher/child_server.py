"""A server run as a child of this process, as a user runs it: `trident up`, or a peer the benchmarks
compare against (`transformers serve`, llama.cpp's `llama-server`).

It runs in a session of its own with its output in a log file, so a Ctrl-C meant for the caller does
not reach it and only `stop` stops it, in order: SIGINT (`trident up` drains its services), a second
SIGINT (which makes `trident up` kill what is left), then SIGKILL to its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from trident.launcher.processes import read_tail

REPO = Path(__file__).resolve().parents[2]
SECOND_INTERRUPT = 30.0  # seconds a second SIGINT gets before SIGKILL


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment plus `extra`; this checkout first on the path, whatever the install."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(argv: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """`argv` running in `cwd`, output appended to `log`, in a session of its own."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_until_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until GET `url` answers 200; RuntimeError if the process exits first, TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{log.stem} exited with {proc.returncode}:\n{read_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{url} not ready after {timeout:.0f} s:\n{read_tail(log)}")
            time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGINT and `timeout` seconds to stop cleanly; then a second SIGINT; then SIGKILL to its group."""
    for signum, wait in ((signal.SIGINT, timeout), (signal.SIGINT, SECOND_INTERRUPT)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
