"""`trident up` over stand-in services (tests/test_launcher.py, tests/planner/test_actuators.py):
compose.yaml with each of our services' commands replaced by a small script that records its argv
and environment, serves /ready, and drains on SIGTERM; and reading what `trident up` prints."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"

STAND_IN = textwrap.dedent(
    """
    import http.server, json, os, signal, socket, sys, threading, time, urllib.parse

    mode = sys.argv[1]
    if mode == "fail":
        print("boom: cannot start", flush=True)
        sys.exit(3)
    out = os.path.join(os.environ["STAND_IN_OUT"], f"{os.getpid()}.json")
    record = {"argv": sys.argv, "env": {k: v for k, v in os.environ.items() if k.startswith("TRIDENT_")}}

    def save(**extra):
        with open(out, "w") as f:
            json.dump({**record, **extra}, f)

    def reachable(url):
        parts = urllib.parse.urlsplit(url)
        try:
            socket.create_connection((parts.hostname, parts.port), timeout=1).close()
            return True
        except OSError:
            return False

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            urls = (os.environ["TRIDENT_NATS_URL"], os.environ["TRIDENT_REDIS_URL"])
            ok = self.path == "/health" or all(reachable(url) for url in urls)
            self.send_response(200 if ok else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    if mode == "stubborn-gateway":  # a gateway that will not stop on SIGTERM: only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        mode = "gateway"
    if mode == "waiting-gateway":  # ready only once every worker stand-in has started, as a real one
        import glob
        started = os.path.join(os.environ["STAND_IN_OUT"], "*.json")
        while len(glob.glob(started)) < int(os.environ["STAND_IN_WORKERS"]):
            time.sleep(0.05)
        mode = "gateway"
    if mode == "gateway":
        address = (os.environ["TRIDENT_BIND_HOST"], int(os.environ["TRIDENT_PORT"]))
        server = http.server.ThreadingHTTPServer(address, Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    stopped = []  # a list, not a threading.Event: Event.set in a handler can deadlock Event.wait
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, lambda *a: stopped.append(1))
    save()
    while not stopped:
        time.sleep(0.05)
    save(drained=True)
    """
)


def stand_in_compose(tmp_path: Path, decode_mode: str = "worker", gateway_mode: str = "gateway") -> Path:
    """The repository's compose.yaml with each service's command replaced by the stand-in."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    data = yaml.safe_load(COMPOSE.read_text())
    for name, service in data["services"].items():
        ours = str(service.get("image", "")).startswith("trident")  # not nats, redis, prometheus, grafana
        if ours and "command" in service and name not in ("secrets-init", "model-init"):
            mode = gateway_mode if name == "gateway" else decode_mode if name == "decode" else "worker"
            service["command"] = ["python", str(script), mode]
            service["stop_grace_period"] = "3s"  # what a stubborn stand-in costs a test before SIGKILL
            service["environment"]["STAND_IN_OUT"] = "${STAND_IN_OUT}"  # interpolated from the caller
    path = tmp_path / "compose.test.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def stop_up(proc: subprocess.Popen) -> None:
    """After a failed test: Ctrl-C first, so `trident up` stops the servers and services it started
    (a SIGKILL would orphan them), then SIGKILL if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """`trident up` in tmp_path. typer.run over the command itself skips importing the model stack."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "model").mkdir(exist_ok=True)
    env = {**os.environ, "STAND_IN_OUT": str(out), "TRIDENT_LOG_LEVEL": "DEBUG"}
    env.pop("TRIDENT_NUM_THREADS", None)
    argv = [sys.executable, "-c", "import typer; from trident.cli.up import up; typer.run(up)"]
    argv += ["--model", str(tmp_path / "model"), "--file", str(tmp_path / "compose.test.yaml"), *args]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)  # end of output

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def read_until(lines: queue.Queue[str | None], prefix: str | None, timeout: float = 30.0) -> list[str]:
    """Output lines up to the first that starts with `prefix` (None: to the end of the output)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            if prefix is None:
                return seen
            break
        seen.append(line)
        if prefix is not None and line.startswith(prefix):
            return seen
    raise AssertionError(f"no line starting with {prefix!r} in {timeout} s:\n" + "\n".join(seen))


def stand_in_record(tmp_path: Path, pid: int, timeout: float = 10.0) -> dict:
    """What the stand-in with this pid wrote: its argv and TRIDENT_* environment, and whether it drained.

    The gateway may be ready before a worker has written its record: wait for a whole one.
    """
    path = tmp_path / "out" / f"{pid}.json"
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.05)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
