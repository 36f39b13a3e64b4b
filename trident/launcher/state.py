"""`.trident/up.json`: what a running `trident up` started, so `trident down` can stop it.

Every pid is stored with its start time from /proc and the command it runs, so a pid that the
kernel has since given to another process is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Everything `trident up` writes lives under HOME, relative to the directory it runs in: models, logs,
# server files, the state file (the same place `trident generate` keeps the tiny model).
HOME = Path(".trident")
STATE = HOME / "up.json"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after its last ')' are plain.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, not yet reaped by its parent
        return None
    return int(fields[19])  # field 22 of proc(5), counted from field 3


def cmdline(pid: int) -> list[str]:
    """The process's command line from /proc ([] if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def program(argv: Sequence[str]) -> str:
    """The program's file name: the first word of argv[0], as a server that retitles itself keeps it
    (redis-server shows `redis-server 127.0.0.1:6379` in place of its arguments)."""
    words = argv[0].split() if argv else []
    return Path(words[0]).name if words else ""


def identity(pid: int | None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What the state file records for a process: pid, start time and the command it was started with
    (by default what /proc shows now, right for this process, not for a child that may not have run
    exec yet)."""
    if not pid:
        return {"pid": None, "start": None, "argv": []}
    return {"pid": pid, "start": start_time(pid), "argv": list(argv) if argv is not None else cmdline(pid)}


def is_alive(record: dict[str, Any] | None) -> bool:
    """True if the recorded process still runs: same pid, same start time, same program."""
    if not record or not record.get("pid"):
        return False
    pid = int(record["pid"])
    now = start_time(pid)
    if now is None or (record.get("start") is not None and now != record["start"]):
        return False
    # A state file written before commands were recorded has none; the start time then stands alone.
    return not record.get("argv") or program(cmdline(pid)) == program(record["argv"])


def send(record: dict[str, Any] | None, signum: int) -> bool:
    """Signal the recorded process if it is still the same one; True if it was signalled."""
    if not is_alive(record):
        return False
    assert record is not None
    try:
        os.kill(int(record["pid"]), signum)
    except ProcessLookupError:
        return False
    return True


def wait_gone(records: list[dict[str, Any]], timeout: float) -> bool:
    """Wait until none of the recorded processes runs; False on timeout."""
    deadline = time.monotonic() + timeout
    while any(is_alive(r) for r in records):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def terminate(records: list[dict[str, Any]], grace: float) -> int:
    """SIGTERM the live ones, SIGKILL what is left after `grace` seconds; returns how many were running."""
    live = [r for r in records if send(r, signal.SIGTERM)]
    if not wait_gone(live, grace):
        for record in live:
            send(record, signal.SIGKILL)
        wait_gone(live, 5.0)
    return len(live)


def recorded(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The service processes and servers a state file lists."""
    return [*state.get("processes", []), *state.get("servers", {}).values()]


def clear_leftovers(state: dict[str, Any]) -> int:
    """Stop what a `trident up` that died without cleaning up (SIGKILL, OOM) left running, each given
    its stop_grace to drain before SIGKILL; returns how many were still running."""
    leftovers = recorded(state)
    grace = max([float(r.get("stop_grace", 10.0)) for r in leftovers] + [10.0])
    return terminate(leftovers, grace)


class StateFile:
    """The JSON file itself; written atomically so `trident down` never reads half of it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def read(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
