"""One thread that owns a UCX worker and does all UCX work of a process.

ucxx's own asyncio layer polls request completion from the event loop, which on a small machine
spends the CPU the transfers need (we measured 3.7 MB taking 3-8 ms that way, against 0.4 ms
here). This thread instead spins on `progress()` only while transfers are in flight and sleeps
on the worker's epoll descriptor when idle, so an idle service costs nothing. Other threads hand
it work with `call()`; completion callbacks run on it and settle asyncio futures thread-safely.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


# While transfers are in flight, spin on progress as long as something happened within SPIN_IDLE;
# after that wait on the worker's epoll descriptor (woken by the next event, or after SLOW_POLL).
# Spinning keeps latency low on an idle core; giving the core up quickly matters where cores are
# few and busy, since a spinning puller would starve the very owner it waits for.
SPIN_IDLE = 0.0005
SLOW_POLL = 0.001
_PROGRESS_BURST = 64


@dataclass
class _Watch:
    request: Any  # ucxx UCXRequest
    callback: Callable[[Any], None]
    busy: bool  # a transfer in flight (spin) rather than a standing receive (may sleep)


class UcxThread:
    """Runs a UCX worker. `on_start(worker)` and `periodic()` run on this thread."""

    def __init__(
        self,
        config: dict[str, str],
        on_start: Callable[[Any], None],
        periodic: Callable[[], None],
        period: float,
        name: str = "ucx-transfer",
    ) -> None:
        self._config = config
        self._on_start = on_start
        self._periodic = periodic
        self._period = period
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._watches: list[_Watch] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ready = threading.Event()
        self._stopping = False
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.worker: Any = None

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("UCX worker did not start")
        if self._init_error is not None:
            raise self._init_error

    def stop(self, on_stop: Callable[[], None] | None = None) -> None:
        """Run `on_stop` on the thread (close endpoints, fail transfers), then end the thread."""
        if not self._thread.is_alive():
            return
        if on_stop is not None:
            done = threading.Event()

            def last() -> None:
                try:
                    on_stop()
                finally:
                    done.set()

            self.call(last)
            done.wait(10.0)
        self._stopping = True
        self._wake()
        self._thread.join(10.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the UCX thread soon (from any thread)."""
        self._commands.put(fn)
        self._wake()

    def watch(self, request: Any, callback: Callable[[Any], None], busy: bool = True) -> _Watch:
        """Call `callback(request)` on this thread once `request` completes (UCX thread only).

        Set `busy = False` on the returned watch to stop a request that may never complete (its
        peer died) from keeping the thread polling.
        """
        w = _Watch(request, callback, busy)
        self._watches.append(w)
        return w

    def progress(self, rounds: int = 1) -> None:
        """Progress the worker now (UCX thread only)."""
        for _ in range(rounds):
            self.worker.progress()

    def _wake(self) -> None:
        # A full pipe means a wake-up is already pending; a closed one means we are stopping.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # -- the loop ----------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            import ucxx._lib.libucxx as ucx_api

            context = ucx_api.UCXContext(
                self._config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
            )
            self.worker = ucx_api.UCXWorker(context)
            self.worker.init_blocking_progress_mode()
            self._on_start(self.worker)
        except BaseException as exc:
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        next_periodic = time.monotonic() + self._period
        last_activity = 0.0
        while not self._stopping:
            active = self._run_commands()
            for _ in range(_PROGRESS_BURST):
                if not self.worker.progress_once():
                    break
                active = True
            busy, completed = self._reap()
            now = time.monotonic()
            if active or completed:
                last_activity = now
            if now >= next_periodic:
                self._safely(self._periodic)
                next_periodic = now + self._period
            if busy and now - last_activity < SPIN_IDLE:
                time.sleep(0)  # yield the GIL to the event loop thread, then spin on
            elif busy:
                self._sleep(SLOW_POLL)
            elif self._commands.empty():
                self._sleep(min(0.1, max(0.0, next_periodic - now)))
        self._watches.clear()
        self.worker = None

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            self._safely(fn)

    def _reap(self) -> tuple[bool, bool]:
        """Run callbacks of completed requests; returns (transfers still in flight, any completed)."""
        if not self._watches:
            return False, False
        done = [w for w in self._watches if w.request.completed]
        if done:
            self._watches = [w for w in self._watches if not w.request.completed]
            for w in done:
                self._safely(w.callback, w.request)
        return any(w.busy for w in self._watches), bool(done)

    def _sleep(self, timeout: float) -> None:
        """Block until UCX has an event, another thread wakes us, or `timeout` passes."""
        if not self.worker.arm():
            return  # events are pending: progress again instead of sleeping
        try:
            select.select([self.worker.epoll_file_descriptor, self._wake_r], [], [], timeout)
        except (OSError, ValueError):
            return
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    @staticmethod
    def _safely(fn: Callable[..., None], *args: Any) -> None:
        # A failing callback must not stop the thread every transfer depends on.
        try:
            fn(*args)
        except Exception:
            log.exception("error in UCX transfer thread")
