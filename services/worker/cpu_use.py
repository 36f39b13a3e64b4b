"""What the worker's host spends its cores on, for the planner's model of the cost outside the
engines (common/planner/host_cpu.py): counters of the host's busy core-seconds (the kernel's
`/proc/stat`) and of this process's own CPU seconds, which the planner differences between two
reports.

Every worker on a host reports the same host counter; the planner takes the workers' own CPU from
it, and what is left — the gateway, the broker, the store, clients and anything else on those
cores — it charges to the requests that arrived meanwhile. Hosts are told apart by the kernel's
boot id, which containers and network namespaces on one machine share (they share its cores too).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_TICKS = os.sysconf("SC_CLK_TCK")


def host_id() -> str:
    """The kernel this process runs on ("" where it cannot be told)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def host_busy_seconds() -> float | None:
    """Core-seconds the host's cores have been busy since boot (None: not Linux). Idle and
    waiting on I/O are not busy; guest time is counted in user time already."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS


class CpuUse:
    def __init__(self, cores: int = 0) -> None:
        """`cores`: the host's cores the workers' steps share (0: their steps do not run on them)."""
        self.host = host_id()
        self.cores = cores

    def counters(self) -> tuple[float, float]:
        """(the host's busy core-seconds, this process's CPU seconds); (0, 0) where the host's
        cannot be read."""
        busy = host_busy_seconds()
        return (0.0, 0.0) if busy is None else (busy, time.process_time())
