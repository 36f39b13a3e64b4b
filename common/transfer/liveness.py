"""Is a peer process still alive? Answered locally for peers on this host, in this pid namespace.

UCX with error handling off (needed for shared memory) never reports a dead peer: a receive from
it just waits, and a send to it over shared memory even succeeds. So each side names its process
in the transfer protocol, and the other checks /proc while it waits. The check applies only when
both run on the same kernel (boot id) in the same pid namespace; a pid means nothing elsewhere,
and across hosts UCX's TCP lanes do report a reset connection.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessId:
    """A process, unambiguously: where its pid is valid, the pid, and its start time (pids are reused)."""

    scope: str  # "<boot id>:<pid namespace inode>"
    pid: int
    start: int  # clock ticks after boot, field 22 of /proc/<pid>/stat

    def encode(self) -> str:
        return f"{self.scope}:{self.pid}:{self.start}"

    @classmethod
    def decode(cls, text: str) -> ProcessId | None:
        try:
            boot, ns, pid, start = text.rsplit(":", 3)
            return cls(f"{boot}:{ns}", int(pid), int(start))
        except ValueError:
            return None


@functools.cache
def _scope() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{ns}"


def _start_time(pid: int) -> int | None:
    """The start time of a running process, or None if there is none (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # field 3, the state: dead, not yet reaped
        return None
    return int(fields[19])  # field 22 overall


def this_process() -> ProcessId | None:
    """This process's identity, or None where /proc is unavailable (then no peer can check it)."""
    scope, start = _scope(), _start_time(os.getpid())
    if not scope or start is None:
        return None
    return ProcessId(scope, os.getpid(), start)


def checkable(peer: ProcessId | None) -> bool:
    """Whether `peer`'s pid means the same process here (same kernel, same pid namespace)."""
    return peer is not None and bool(peer.scope) and peer.scope == _scope()


def known_dead(peer: ProcessId | None) -> bool:
    """True only when `peer` is checkable from here and is certainly gone."""
    return checkable(peer) and _start_time(peer.pid) != peer.start  # type: ignore[union-attr]
