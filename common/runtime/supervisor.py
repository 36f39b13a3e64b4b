"""A service's long-lived loops, each with a kept handle and a name, none of them silently gone.

A loop that raises, or returns while the service is not stopping, is a failure of the whole
service: it is logged with its traceback, `failure` says which loop and why (what /health
reports), and whoever waits in `wait()` is woken to take the service down. Nothing restarts a
loop in place: a loop that died left its part of the service in an unknown state, and the process
exits non-zero so that its orchestrator starts a fresh one (compose: `restart: unless-stopped`).

Test-only fault hook: with TRIDENT_TEST_FAULT=<loop name>[,<loop name>...] set, SIGUSR1 makes those
loops raise `InjectedFault` (tests/services/test_loop_failure.py). Unset, nothing of it exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)
FAULT_ENV = "TRIDENT_TEST_FAULT"  # test-only: the loops SIGUSR1 makes raise
STOP_TIMEOUT = 5.0  # seconds a loop may take to end once asked to stop

Loop = Callable[[], Awaitable[None]]


class InjectedFault(RuntimeError):
    """Raised inside the loop TRIDENT_TEST_FAULT names, on SIGUSR1 (tests only)."""


@dataclass(frozen=True)
class LoopFailure:
    """Which loop ended the service, and why."""

    loop: str
    error: str

    def __str__(self) -> str:
        return f"loop {self.loop} failed: {self.error}"


class Supervisor:
    def __init__(self, service: str) -> None:
        self.service = service  # the instance, for the log
        self.failure: LoopFailure | None = None
        self.stopping = False  # a stop was asked for: loops may end now
        self._loops: dict[str, asyncio.Task[None]] = {}  # in start order
        self._stoppers: dict[str, Callable[[], None]] = {}  # loops that can be asked to end
        self._ended = asyncio.Event()  # a stop was asked for, or a loop failed
        self._fault_loops = {n.strip() for n in os.environ.get(FAULT_ENV, "").split(",") if n.strip()}
        self._fault = asyncio.Event()
        if self._fault_loops:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._fault.set)

    def start(
        self, name: str, run: Loop, *, may_end: bool = False, stop: Callable[[], None] | None = None
    ) -> None:
        """Run `run()` as the loop `name`. With `may_end` (a job, such as a drain) returning is
        not a failure; raising always is. `stop`, if given, asks the loop to end by itself (an
        HTTP server finishing its responses) before it is cancelled."""
        if name in self._loops:
            raise ValueError(f"{self.service}: a loop named {name!r} runs already")
        body = self._faulty(name, run) if name in self._fault_loops else run
        self._loops[name] = asyncio.create_task(self._guard(name, body, may_end), name=name)
        if stop is not None:
            self._stoppers[name] = stop

    def request_stop(self) -> None:
        """Ask the service to stop (a drain ended, it was fenced): loops may end from now on."""
        self.stopping = True
        self._ended.set()

    async def wait(self) -> LoopFailure | None:
        """Until a stop is asked for or a loop fails; the failure, if that was it."""
        await self._ended.wait()
        return self.failure

    def running(self) -> list[str]:
        return [name for name, task in self._loops.items() if not task.done()]

    async def stop(self, names: Iterable[str] | None = None) -> None:
        """Cancel the named loops (default: all), the last started first, each given
        STOP_TIMEOUT to end; one that will not end is left behind with a warning."""
        self.stopping = True
        chosen = list(self._loops) if names is None else [n for n in self._loops if n in set(names)]
        me = asyncio.current_task()
        for name in reversed(chosen):
            task = self._loops.pop(name)
            if task is me:
                continue
            stopper = self._stoppers.pop(name, None)
            if stopper is not None:
                stopper()
                await asyncio.wait({task}, timeout=STOP_TIMEOUT)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT)
            if not done:
                log.warning("%s: loop %s did not end within %.0fs", self.service, name, STOP_TIMEOUT)

    async def _guard(self, name: str, run: Loop, may_end: bool) -> None:
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(name, exc)
            return
        if not (may_end or self.stopping):
            self._fail(name, None)

    def _fail(self, name: str, exc: Exception | None) -> None:
        error = "it returned while the service ran" if exc is None else f"{type(exc).__name__}: {exc}"
        if self.stopping and exc is None:
            return
        log.critical("%s: loop %s failed (%s); stopping the service", self.service, name, error, exc_info=exc)
        if self.failure is None:
            self.failure = LoopFailure(name, error)
        self._ended.set()

    def _faulty(self, name: str, run: Loop) -> Loop:
        """`run`, raising InjectedFault once SIGUSR1 arrives (the test-only fault hook)."""

        async def faulty() -> None:
            body = asyncio.ensure_future(run())
            trip = asyncio.ensure_future(self._fault.wait())
            try:
                await asyncio.wait({body, trip}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (body, trip):
                    task.cancel()
                await asyncio.gather(body, trip, return_exceptions=True)
            if trip.done() and not trip.cancelled():
                raise InjectedFault(f"fault injected into {name} ({FAULT_ENV}, SIGUSR1)")
            body.result()  # the loop's own end or error

        return faulty
