"""The warm starter (trident/launcher/warm.py): a service forked from the forkserver runs as its own
command line would — its module as `__main__`, its environment, its log — and reads like a Popen;
and when its caller is SIGKILLed, the forkserver and every fork go too (the forks drain on SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.deploy import WARM
from trident.launcher.warm import Forked, WarmStarter, module_of

CHILD = [sys.executable, "-m", "tests.warm_child"]


def until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_only_service_modules_run_by_this_interpreter_are_forked():
    assert module_of([sys.executable, "-m", "services.worker"]) == "services.worker"
    assert module_of([sys.executable, "-m", "celery", "worker"]) is None
    assert module_of(["/usr/bin/python3", "-m", "services.worker"]) is None
    assert module_of([sys.executable, "script.py"]) is None


def test_a_fork_runs_its_module_with_its_environment_and_log_and_reads_like_a_popen(tmp_path: Path):
    # This lane's one forkserver is the suite's (tests/deploy.py): asking it for another preload
    # would change what the lane's later services find imported, should this test start it.
    starter = WarmStarter(preload=WARM.preloaded, packages=("tests.",))
    env = {**os.environ, "WARM_CHILD_OUT": str(tmp_path), "WARM_CHILD_MARK": "mine"}
    log = tmp_path / "child.log"
    proc = starter.start(CHILD, env, log)
    assert isinstance(proc, Forked)
    until(lambda: (tmp_path / f"{proc.pid}.started").exists(), 30, "the fork started")
    assert proc.poll() is None and proc.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0 and (tmp_path / f"{proc.pid}.drained").exists()
    assert f"child {proc.pid} argv [] env mine" in log.read_text()
    proc.kill()  # after its exit: nothing happens

    failing = starter.start(CHILD, {**env, "WARM_CHILD_EXIT": "70"}, log)
    assert failing.wait(30) == 70
    plain = starter.start([sys.executable, "-c", "raise SystemExit(3)"], env, log)
    assert isinstance(plain, subprocess.Popen) and plain.wait(30) == 3


CALLER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from trident.launcher.warm import WarmStarter
    out = Path(sys.argv[1])
    starter = WarmStarter(preload=(), packages=("tests.",))
    env = {**os.environ, "WARM_CHILD_OUT": str(out)}
    child = [sys.executable, "-m", "tests.warm_child"]
    forks = [starter.start(child, env, out / "child.log") for _ in range(2)]
    print(" ".join(str(f.pid) for f in forks), flush=True)
    time.sleep(600)
    """
)


def test_a_killed_caller_takes_the_forkserver_and_its_forks_with_it(tmp_path: Path):
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 2
        until(lambda: all((tmp_path / f"{p}.started").exists() for p in pids), 30, "both forks started")
        server = int((tmp_path / f"{pids[0]}.started").read_text())  # their parent: the forkserver
        assert server != caller.pid
        caller.kill()
        caller.wait()
        until(lambda: all((tmp_path / f"{p}.drained").exists() for p in pids), 30, "the forks drained")
        until(lambda: not any(alive(p) for p in [*pids, server]), 30, "the forkserver and forks gone")
    finally:
        caller.kill()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
