"""The deployments `trident bench compare` measures, each started as subprocesses on one checkpoint.

`trident(...)` runs `trident up` (compose.yaml's services as local processes, through
trident/launcher/local_up.py) for one of the four methods; `transformers_serve(...)` runs the peer,
`transformers serve`. Each is a context manager that starts the deployment, waits until it serves,
yields a `Served`, and on exit stops it and everything it started (trident/launcher/child_server.py),
so the next deployment has the machine to itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.secrets import DeploymentSecrets
from trident.launcher import child_server
from trident.launcher.local_up import LocalUp, UpCommand
from trident.launcher.processes import read_tail
from trident.launcher.state import HOME

REPO = child_server.REPO
TRIDENT = "trident"
PEER = "transformers-serve"


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
def trident(command: UpCommand, stop_timeout: float = 150.0) -> Iterator[Served]:
    """`trident up` as `command` says, until the block ends. Start-up includes each worker's
    profiling; `command.ready_timeout` bounds it (600 s unless it says)."""
    if command.ready_timeout is None:
        command = dataclasses.replace(command, ready_timeout=600.0)
    up = LocalUp(command)
    try:
        # `trident up` gives up after ready_timeout itself; the margin is for its own start.
        up.wait_ready(command.ready_timeout + 30)
        yield Served(
            f"{TRIDENT} {command.method}",
            TRIDENT,
            up.url,
            _served_model(up.url, command.model),
            up.proc.pid,
            up.workdir / HOME / "logs",
            planner_url=up.planner_url,
            planner_key=DeploymentSecrets.read(up.workdir / HOME / "secrets").planner_key,
        )
    finally:
        up.stop(stop_timeout)


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
) -> Iterator[Served]:
    """`transformers serve` with `model_dir` preloaded, on CPU, until the block ends.

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
        "--device", "cpu",
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
        argv,
        env=env,
        log=log,
        url=url,
        model=model if warm_up else None,
        ready_timeout=ready_timeout,
        stop_timeout=stop_timeout,
    ) as proc:
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
    proc = child_server.start(argv, child_server.child_env(env), log.parent, log)
    try:
        # the model loads before it listens
        child_server.wait_until_ok(f"{url}/health", proc, log, ready_timeout)
        if model is not None:
            _warm_up(url, model, log, ready_timeout)
        yield proc
    finally:
        child_server.stop(proc, stop_timeout)


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
