"""Service processes forked from one warm parent instead of each started from a bare interpreter.

Each service process otherwise imports torch and transformers anew: about 9 s of CPU apiece, which on
a small machine is most of a deployment's start-up (four processes importing side by side on two
cores take ~20 s; forked, they are serving in ~3). A warm starter keeps a multiprocessing forkserver
that imported the services' modules once; each start forks it and runs the service's module as
`python -m` would, with the service's own environment and log file. The fork has run no torch op,
so no thread pool is carried into it, and what the service reads from its environment it reads in
`main()`, after the fork.

The process is a child of the forkserver, not of the caller: `Forked` gives it Popen's face (pid,
poll, wait, signals), and its exit status comes back through the forkserver. If the caller dies, the
forkserver sees its pipe close and exits, and its children get SIGTERM (the parent-death signal) and
drain, as `trident up`'s children do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.infra.process import die_with_parent
from trident.launcher.processes import plain_start

# What every service's entry point imports; the forkserver imports them once.
PRELOAD = (
    "torch",
    "transformers",
    "services.settings",
    "services.stages",
    "services.worker.main",
    "services.encoder.handler",
    "services.prefill.handler",
    "services.decode.handler",
    "services.gateway.app",
    "services.gateway.server",
)


def module_of(argv: Sequence[str]) -> str | None:
    """The module of a `python -m MODULE` command line run by this interpreter, else None."""
    if len(argv) == 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2]
    return None


class Forked:
    """A forked service process, read and signalled as a `subprocess.Popen` is."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: Sequence[str]) -> None:
        self._process = process
        self.args = list(argv)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """Starts `python -m services.*` command lines as forks of a warm forkserver; any other command
    line as a plain child process."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self._preload = list(preload)
        self._context: multiprocessing.context.ForkServerContext | None = None

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> Forked | subprocess.Popen:
        module = module_of(argv)
        if module is None:
            return plain_start(argv, env, log)
        if self._context is None:
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(self._preload)
        process = self._context.Process(
            target=run_module, args=(module, dict(env), str(log), list(argv)), name=module, daemon=False
        )
        process.start()
        return Forked(process, argv)


def run_module(module: str, env: dict[str, str], log: str, argv: list[str]) -> None:
    """In the fork: become the service process `argv` describes, then run its module as `-m` does."""
    arm = die_with_parent(parent=os.getppid())
    if arm is not None:
        arm()  # the forkserver's death (its caller's) ends this process
    os.setsid()  # a session of its own, as plain_start gives: a terminal's Ctrl-C reaches the caller alone
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.argv = [*argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
