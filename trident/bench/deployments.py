"""The deployments `trident bench compare` measures, each started as subprocesses on one checkpoint.

`trident(...)` runs `trident up` (compose.yaml's services as local processes) for one of the four
methods; `transformers_serve(...)` runs the peer, `transformers serve`. Each is a context manager
that starts the deployment, waits until it serves, yields a `Served`, and on exit stops it and
everything it started (SIGINT, then SIGKILL after a grace period, then whatever a killed
`trident up` left behind), so the next deployment has the machine to itself.

`trident up` runs in `log_dir` as its working directory: its state file, its NATS/Redis data and
the services' logs (`log_dir/.trident/logs/`) stay apart from any other `trident up` on the machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.compose import Method
from common.infra import free_port
from common.secrets import DeploymentSecrets
from trident.cli.up import STATE
from trident.launcher.processes import read_tail
from trident.launcher.state import StateFile, clear_leftovers

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
TRIDENT = "trident"
PEER = "transformers-serve"
# `trident` is the console script for trident.cli.app:app; this runs the same app with this interpreter.
_TRIDENT_MAIN = "from trident.cli.app import app; app(prog_name='trident')"


@dataclass(frozen=True)
class Served:
    """A deployment that serves: what a client needs to send it requests."""

    name: str  # "trident e+p+d", "transformers-serve", ...
    kind: str  # TRIDENT | PEER
    url: str  # base URL, without /v1
    model: str  # the value of requests' "model" field
    pid: int  # the process started (`trident up` or `transformers serve`)
    logs: Path  # where its logs are
    planner_url: str | None = None  # Trident's planner service (POST /plan/replan)
    planner_key: str = ""  # what its writes take: the deployment's planner-key secret

    def ignoring_eos(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A chat/completions request body made to generate exactly its `max_tokens` tokens here.

        Trident takes vLLM's `ignore_eos`. `transformers serve` answers 422 to any field it does not
        know (`ignore_eos`, `min_tokens`), but takes a `generation_config` JSON string, which it
        builds the request's generation config from (the model's own fills what it leaves unset);
        `min_new_tokens` = `max_tokens` masks EOS until the last token.
        """
        if self.kind == PEER:
            if body.get("max_tokens") is None:
                return dict(body)
            return {**body, "generation_config": json.dumps({"min_new_tokens": int(body["max_tokens"])})}
        return {**body, "ignore_eos": True}


@contextlib.contextmanager
def trident(
    model_dir: Path,
    method: str,
    *,
    port: int,
    scale: dict[str, int] | None = None,
    env: dict[str, str] | None = None,
    log_dir: Path,
    ready_timeout: float = 600.0,
    stop_timeout: float = 150.0,
) -> Iterator[Served]:
    """`trident up --method METHOD` on `model_dir`, its gateway on `port`, until the block ends.

    `env` is added to this process's environment for `trident up`, whose services get it under
    compose.yaml's own (TRIDENT_POLICY, TRIDENT_KV_LAYER_GROUP, TRIDENT_PREFETCH... reach every
    worker). Start-up includes each worker's profiling; `ready_timeout` bounds it.
    """
    Method(method)  # ValueError for an unknown method, before anything starts
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    planner_port = free_port()
    argv = [
        sys.executable, "-c", _TRIDENT_MAIN, "up",
        "--model", str(Path(model_dir).resolve()),
        "--method", method,
        "--port", str(port),
        "--planner-port", str(planner_port),
        "--file", str(COMPOSE),
        "--ready-timeout", str(ready_timeout),
    ]  # fmt: skip
    for name, count in (scale or {}).items():
        argv += ["--scale", f"{name}={count}"]
    url = f"http://127.0.0.1:{port}"
    log = log_dir / "trident-up.log"
    proc = _start(argv, _env(env), log_dir, log)
    try:
        # `trident up` gives up after ready_timeout itself; the margin is for its own start.
        _wait_until_ok(f"{url}/ready", proc, log, ready_timeout + 30)
        yield Served(
            f"{TRIDENT} {method}", TRIDENT, url, _served_model(url, model_dir), proc.pid,
            log_dir / ".trident" / "logs", planner_url=f"http://127.0.0.1:{planner_port}",
            planner_key=DeploymentSecrets.read(log_dir / ".trident" / "secrets").planner_key,
        )  # fmt: skip
    finally:
        _stop(proc, stop_timeout)
        _clean_up_after(log_dir)


@contextlib.contextmanager
def transformers_serve(
    model_dir: Path,
    *,
    port: int,
    continuous_batching: bool = False,
    log_dir: Path,
    ready_timeout: float = 300.0,
    stop_timeout: float = 30.0,
    warm_up: bool = True,
    device: str = "cpu",
) -> Iterator[Served]:
    """`transformers serve` with `model_dir` preloaded, on `device`, until the block ends.

    It needs `accelerate` (transformers' `serving` extra): it always loads with a device_map.
    Requests must name the model as the path it was started with (`Served.model`), or none.
    Continuous batching applies to text-only models alone: for LLaVA it logs that it falls back to
    sequential generation, one request at a time, exactly as without the flag.
    `warm_up` sends one short request before yielding, so the first measured one pays no first-call
    costs (Trident's workers are warm from their start-up profiling).
    """
    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError(
            "transformers serve needs accelerate (pip install 'transformers[serving]'): "
            "it loads every model with a device_map"
        )
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(Path(model_dir).resolve())
    argv = [
        sys.executable, "-m", "transformers.cli.transformers", "serve", model,
        "--device", device,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", "info",
        "--continuous-batching" if continuous_batching else "--no-continuous-batching",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    name = PEER + ("-cb" if continuous_batching else "")
    log = log_dir / f"{name}.log"
    # A local checkpoint: never wait on the Hub (there may be no network).
    env = {"HF_HUB_OFFLINE": "1"}
    with peer_server(
        argv, env=env, log=log, url=url, model=model if warm_up else None,
        ready_timeout=ready_timeout, stop_timeout=stop_timeout,
    ) as proc:  # fmt: skip
        yield Served(name, PEER, url, model, proc.pid, log)


# -- processes --------------------------------------------------------------------------------------


@contextlib.contextmanager
def peer_server(
    argv: list[str],
    *,
    env: Mapping[str, str] | None,
    log: Path,
    url: str,
    model: str | None,
    ready_timeout: float,
    stop_timeout: float,
) -> Iterator[subprocess.Popen[bytes]]:
    """A peer's server process (`argv`, in the log's folder, output to `log`), once GET `url`/health
    answers 200 and, with `model`, one short request has warmed it up; stopped when the block ends."""
    proc = _start(argv, _env(env), log.parent, log)
    try:
        _wait_until_ok(f"{url}/health", proc, log, ready_timeout)  # the model loads before it listens
        if model is not None:
            _warm_up(url, model, log, ready_timeout)
        yield proc
    finally:
        _stop(proc, stop_timeout)


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """This environment plus `extra`; this checkout first on the path, whatever the install."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """`argv` running in `cwd`, output appended to `log`, in a session of its own: a Ctrl-C meant for
    the caller does not reach it, so only `_stop` stops it, and in order."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _served_model(url: str, model_dir: Path) -> str:
    """The model name the gateway serves (TRIDENT_MODEL_NAME, else the checkpoint directory's name)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
        return httpx.get(f"{url}/v1/models", timeout=5, trust_env=False).json()["data"][0]["id"]
    return Path(model_dir).resolve().name


def _warm_up(url: str, model: str, log: Path, timeout: float) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout, trust_env=False)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"the warm-up request failed: {exc}") from None
    if answer.status_code != 200:
        reply = f"{answer.status_code} {answer.text[:300]}"
        raise RuntimeError(f"the warm-up request got {reply}:\n{read_tail(log)}")


def _wait_until_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until GET `url` answers 200; RuntimeError if the process exits first, TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{log.stem} exited with {proc.returncode}:\n{read_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{url} not ready after {timeout:.0f} s:\n{read_tail(log)}")
            time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGINT (a clean stop: `trident up` drains its services in order), SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _clean_up_after(run_dir: Path) -> None:
    """What a `trident up` that was killed (or crashed) left running: `trident down`'s clean-up."""
    state_file = StateFile(run_dir / STATE)
    state = state_file.read()
    if state is None:  # a clean stop removes it
        return
    clear_leftovers(state)
    state_file.remove()
