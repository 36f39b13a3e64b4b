"""The service processes of `trident up`: start with a log, restart by compose's policy, stop in order."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from common.infra.process import die_with_parent
from trident.launcher.specs import ProcessSpec

# Docker's restart back-off, in spirit: short at first, doubling while the process keeps dying quickly.
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
# A process that ran at least this long before exiting counts as healthy: its next restart is immediate.
STABLE_RUN = 10.0


def restart_delay(policy: str, returncode: int, ran_for: float, previous: float) -> float | None:
    """Seconds before restarting a process that exited, or None when compose's `restart` policy says not to.

    `on-failure:N`'s retry limit is not enforced; the back-off bounds a crash loop instead.
    """
    if policy in ("always", "unless-stopped") or (policy.startswith("on-failure") and returncode != 0):
        if ran_for >= STABLE_RUN or previous <= 0:
            return FIRST_BACKOFF
        return min(previous * 2, MAX_BACKOFF)
    return None


class Process(Protocol):
    """A started service process: a `subprocess.Popen`, or what a warm starter gives (warm.py)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...


class Starter(Protocol):
    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> Process: ...


def plain_start(argv: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """A child process of its own session, output appended to `log`, killed with its parent."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            preexec_fn=die_with_parent(),  # prctl only: nothing in the forked child takes a lock
        )


class PlainStarter:
    """Each service process from a bare interpreter, as compose's command line says."""

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> Process:
        return plain_start(argv, env, log)


def read_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))  # enough for any tail we print
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Child:
    """One service process, output appended to `<log_dir>/<name>.log`.

    It runs in a session of its own, so Ctrl-C in the terminal reaches `trident up` alone, which then
    stops the services in order (gateway first, so in-flight requests finish on live workers). If
    `trident up` dies without that (SIGKILL), the kernel sends the service SIGTERM: it drains and exits.
    """

    def __init__(
        self, spec: ProcessSpec, log_dir: Path, base_env: Mapping[str, str], starter: Starter | None = None
    ) -> None:
        self.spec = spec
        self.starter = starter or PlainStarter()
        self.log_path = log_dir / f"{spec.name}.log"
        # The caller's environment under the compose one, as a container's image ENV is under compose's.
        self.env = {**base_env, **spec.env}
        self.proc: Process | None = None
        self.started_at = 0.0
        self.backoff = 0.0
        self.restart_at: float | None = None  # monotonic time of a pending restart
        self.restarts = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.restart_at = None
        with open(self.log_path, "ab") as log:
            log.write(f"--- trident up: {time.strftime('%F %T')} {' '.join(self.spec.argv)}\n".encode())
        self.proc = self.starter.start(self.spec.argv, self.env, self.log_path)
        self.started_at = time.monotonic()

    def schedule_restart(self, now: float) -> float | None:
        """After an exit: when to restart (and note it), or None if the policy leaves the process down."""
        code = self.returncode
        assert code is not None, "schedule_restart() is for a process that has exited"
        delay = restart_delay(self.spec.restart, code, now - self.started_at, self.backoff)
        if delay is not None:
            self.backoff = delay
            self.restart_at = now + delay
            self.restarts += 1
        return delay

    def signal(self, signum: int) -> None:
        if self.running:
            assert self.proc is not None
            # It may exit between the check and the signal.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)

    def log_tail(self, lines: int = 30) -> str:
        return read_tail(self.log_path, lines)


def stop_children(
    children: Iterable[Child],
    force: Callable[[], bool] = lambda: False,
    on_kill: Callable[[Child], None] = lambda child: None,
) -> None:
    """SIGTERM them all (they drain); SIGKILL any outliving its stop_grace, or all once `force()`."""
    children = [c for c in children if c.running]
    for child in children:
        child.restart_at = None
        child.signal(signal.SIGTERM)
    start = time.monotonic()
    killed: set[str] = set()
    while any(c.running for c in children):
        now = time.monotonic()
        for child in children:
            late = force() or now - start >= child.spec.stop_grace
            if child.running and late and child.name not in killed:
                killed.add(child.name)
                on_kill(child)
                child.signal(signal.SIGKILL)
        time.sleep(0.05)
    for child in children:
        if child.proc is not None:
            child.proc.wait()
