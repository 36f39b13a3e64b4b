"""Torch threads matched, step by step, to the cores that co-located workers leave free.

Workers on one host split its cores (`trident up`: cores // workers each), so that under load
their torch threads do not oversubscribe the cores and spin against each other. At low load the
split leaves cores idle: an EP instance alone with a request computes it on half the machine, and
its TTFT is twice what one process with every core gives.

A core board is a small file that every worker on the host maps (`TRIDENT_CORE_BOARD`): one slot
per worker, holding its pid, whether an engine step is running and when its last one ended.
Before each step a worker that encodes or prefills marks itself busy and takes the cores the others
leave: all of them when no other has stepped within RECENT seconds, an even share otherwise. A
decode-only worker marks its steps too but keeps its share: changing its threads while another
worker's step ran stalled its decode steps for up to a second (OpenMP teams spinning on
oversubscribed cores), and a small decode step gains nothing from more threads. A worker under load
steps back to back, so it counts as busy between its steps too: taking its cores for the gap
would oversubscribe them at its next step (on small-llava EP+D, a board without that grace
served 1.4 req/s where the fixed split served 2.2). A slot whose process is gone counts as idle,
and is taken over by the next worker to start.

A greedy worker looks again before each layer of its model (`threads_now`), not only before each
step. A request it prefilled on every core goes on to the decoder, which starts stepping while
this worker runs its next step: with the threads fixed for the step, three threads ran on two
cores for the whole of it, and an image's encode and prefill of 0.5–0.7 s took 1.6–3.1 s (small-
llava EP+D at 0.7 req/s, bench/process_profile.py: 3 of 58 requests). Per layer, the overlap lasts
one layer: none of 58 was over twice the median, and the median TTFT went from 688 to 544 ms.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from pathlib import Path

from common.threads import RECENT, greedy_threads

log = logging.getLogger(__name__)

SLOTS = 64
SLOT = struct.Struct("<qqd")  # pid, busy (0/1), monotonic time its last step ended
SIZE = SLOTS * SLOT.size


class CoreBoard:
    def __init__(self, path: str | Path, cores: int, greedy: bool = True) -> None:
        """`greedy` False: this worker marks its steps for the others but keeps its own threads
        (a decode-only worker: its steps are small, gain nothing from more threads, and changing a
        step's threads while another worker's step runs stalled decode steps for up to a second)."""
        self.cores = max(1, cores)
        self.greedy = greedy
        self.pid = os.getpid()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # claiming a slot: one worker at a time
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
            self.slot = self._claim()
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._ended = 0.0
        self._layer_threads: list[int] = []  # this step's threads, layer by layer (greedy only)
        self._overlap: list[int] = []  # other workers seen stepping during this step

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _, _ = SLOT.unpack_from(self._map, i * SLOT.size)
            if pid == 0 or not _alive(pid):
                SLOT.pack_into(self._map, i * SLOT.size, self.pid, 0, 0.0)
                return i
        raise RuntimeError(f"the core board has no free slot ({SLOTS} workers on one host)")

    def _others(self) -> tuple[int, int]:
        """Other workers on this host in use (stepping now or within RECENT seconds), and of
        those, stepping now."""
        now, in_use, stepping = time.monotonic(), 0, 0
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, busy, ended = SLOT.unpack_from(self._map, i * SLOT.size)
            if pid and (busy or now - ended < RECENT) and _alive(pid):
                in_use += 1
                stepping += bool(busy)
        return in_use, stepping

    def busy_others(self) -> int:
        """Workers on this host stepping now or within RECENT seconds, this one not counted."""
        return self._others()[0]

    def begin_step(self) -> int | None:
        """Mark this worker busy; the torch threads its step may use now (None: keep its own)."""
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid, 1, self._ended)
        self._layer_threads.clear()
        in_use, stepping = self._others()
        self._overlap[:] = [stepping]
        return greedy_threads(self.cores, in_use) if self.greedy else None

    def threads_now(self) -> int | None:
        """The torch threads this worker may use now, mid-step too (None: keep its own)."""
        if not self.greedy:
            return None
        in_use, stepping = self._others()
        self._overlap.append(stepping)
        return greedy_threads(self.cores, in_use)

    def follow_by_layer(self, model) -> None:
        """Before each layer of `model` (every module in a ModuleList: the LLM's decoder layers,
        the vision tower's blocks), set torch's threads to `threads_now` again. Nothing for a
        worker that keeps its threads."""
        if not self.greedy:
            return
        import torch

        def retake(*_) -> None:
            threads = self.threads_now()
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            self._layer_threads.append(torch.get_num_threads())

        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(retake)

    def step_threads(self) -> float:
        """The torch threads the step running (or just run) has had: their mean over its layers,
        which a greedy worker may change mid-step; otherwise the threads it has now. For the step
        log, so that the planner can tell a step that had every core from one that had its share."""
        import torch

        if self._layer_threads:
            return sum(self._layer_threads) / len(self._layer_threads)
        return float(torch.get_num_threads())

    def step_overlap(self) -> float:
        """How many other workers' steps ran beside the step running (or just run): the mean of
        what this worker saw at its start, before each of its layers (a greedy worker) and now.
        For the step log: steps beside others' run slower than alone even on cores of their own
        (shared caches and memory bandwidth, the host's other processes)."""
        seen = [*self._overlap, self._others()[1]]
        return sum(seen) / len(seen)

    def end_step(self) -> None:
        self._ended = time.monotonic()
        SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid, 0, self._ended)

    def close(self) -> None:
        SLOT.pack_into(self._map, self.slot * SLOT.size, 0, 0, 0.0)
        self._map.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
