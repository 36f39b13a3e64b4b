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
from multiprocessing import forkserver
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


def module_of(argv: Sequence[str], packages: Sequence[str] = ("services.",)) -> str | None:
    """The module of a `python -m MODULE` command line run by this interpreter, where MODULE is in
    one of `packages`; else None (anything else, the planner's Celery worker say, starts plainly)."""
    if (
        len(argv) == 3
        and argv[0] == sys.executable
        and argv[1] == "-m"
        and argv[2].startswith(tuple(packages))
    ):
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
    line as a plain child process. A process has one forkserver (multiprocessing's): starters in one
    process share it, and it imports the preload of the first start."""

    def __init__(self, preload: Sequence[str] = PRELOAD, packages: Sequence[str] = ("services.",)) -> None:
        self._preload = list(preload)
        self._packages = tuple(packages)  # the modules it forks; any other command starts plainly
        self._context: multiprocessing.context.ForkServerContext | None = None

    def context(self) -> multiprocessing.context.ForkServerContext:
        """The forkserver context its forks come from (the server starts, importing the preload, on
        the first start): any process made from it, not only a service, skips those imports."""
        if self._context is None:
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(self._preload)
        return self._context

    @property
    def preloaded(self) -> tuple[str, ...]:
        return tuple(self._preload)

    def preload(self, modules: Sequence[str]) -> None:
        """Have the forkserver import `modules` instead, when it starts (the first start; later, this
        changes nothing): a caller whose forks are no services needs only what they import."""
        self._preload = list(modules)
        if self._context is not None:
            self._context.set_forkserver_preload(self._preload)

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> Forked | subprocess.Popen:
        module = module_of(argv, self._packages)
        if module is None:
            return plain_start(argv, env, log)
        process = self.context().Process(
            target=run_module, args=(module, dict(env), str(log), list(argv)), name=module, daemon=True
        )  # daemon: should the caller exit with it still running, multiprocessing sends it SIGTERM
        process.start()
        return Forked(process, argv)


def run_module(module: str, env: dict[str, str], log: str, argv: list[str]) -> None:
    """In the fork: become the service process `argv` describes, then run its module as `-m` does."""
    arm = die_with_parent(parent=os.getppid())
    if arm is not None:
        arm()  # the forkserver's death (its caller's) ends this process
    _let_the_forkserver_go()
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


def _let_the_forkserver_go() -> None:
    """Close this fork's copy of the forkserver's keep-alive pipe. multiprocessing hands it to every
    fork, so that a fork could start processes of its own, and the forkserver runs until the last
    copy closes: kept here, the forkserver would outlive its caller, and so would this process,
    whose parent-death signal is armed on the forkserver."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None
