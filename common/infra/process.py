"""What a locally started server has in common: a child process, a work dir, a port, a readiness wait."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

log = logging.getLogger(__name__)


class InfraError(RuntimeError):
    """A server binary is missing, or a server did not come up in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, from below the kernel's ephemeral range.

    A port the kernel hands out for `bind(0)` or an outgoing connection can be taken by any
    process between this call and the caller's bind (a worker's NATS client did, to a gateway in
    CI). Ports below the ephemeral range are never handed out that way, so only another caller of
    this function could take one; each process hands a port out once.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - _OWN_RANGE), low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


_OWN_RANGE = 12000  # how far below the ephemeral range free_port looks
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152, and anything below works there too


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up here, not in the forked child


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> Callable[[], None] | None:
    """A `preexec_fn` after which the kernel sends the child `signum` when its parent dies, even by
    SIGKILL, so a launcher's servers and services do not outlive it as orphans holding their ports.

    Linux only (None elsewhere). The kernel means the parent *thread*: start such children from a
    thread that lives as long as the launcher does (its main thread). `parent`: the pid the child's
    parent must have (this process by default; a forked child names its parent's).
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid() if parent is None else parent

    def preexec() -> None:
        zero = ctypes.c_ulong(0)
        prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), zero, zero, zero)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signum)

    return preexec


class LocalServer:
    """A server run as a child process on a loopback port, usable as a context manager.

    The port and work directory survive `stop()`/`restart()`, so clients reconnect to the same
    address and NATS finds its JetStream store again. Subclasses give the command line and the
    readiness probe.
    """

    name = "server"

    def __init__(
        self, workdir: str | Path | None = None, port: int | None = None, host: str = "127.0.0.1"
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"trident-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or 0
        self.log_path = self.workdir / f"{self.name}.log"
        # With it, the server gets SIGTERM when the process that started it dies (see die_with_parent).
        self.die_with_parent = False
        self.command: list[str] = []  # the argv of the last start, as /proc shows it before any retitling
        # Prepended to `argv()` at each start: `ip netns exec NAME` runs the server on another "host".
        self.wrap: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> None:
        """Start and return once the server answers; a lost race for a free port is retried."""
        fixed_port = self.port != 0
        for _ in range(3):
            if not fixed_port:
                self.port = free_port(self.host)
            self._spawn()
            if self._wait_ready(timeout):
                log.info("%s ready on %s:%d", self.name, self.host, self.port)
                return
            self.kill()
            if fixed_port:
                break
        raise InfraError(f"{self.name} did not become ready on port {self.port}:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        """Stop cleanly: SIGTERM (both servers flush and exit on it), SIGKILL after `grace` seconds."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0fs; killing it", self.name, grace)
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: a crash, for tests of what survives one."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, timeout: float = 20.0) -> None:
        """Stop and start again on the same port with the same files."""
        self.stop()
        self.start(timeout)

    def close(self) -> None:
        """Stop, and remove the work directory if this object made it."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def address(self) -> str:
        """Where it listens, without credentials: what may be printed or logged."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- for subclasses --------------------------------------------------------------------------
    def argv(self) -> list[str]:
        """The command line for the current port and work dir."""
        raise NotImplementedError

    def ready(self) -> bool:
        """True once the server answers requests."""
        raise NotImplementedError

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as logf:
            # A session of its own keeps the server out of the terminal's process group, so Ctrl-C reaches
            # the parent alone and the parent stops the server in order.
            self.command = [*self.wrap, *self.argv()]
            self._proc = subprocess.Popen(
                self.command,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent() if self.die_with_parent else None,
            )

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                return False
            if self.ready():
                return True
            time.sleep(0.05)
        return False
