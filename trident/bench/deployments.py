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
    log_dir: Path,
    continuous_batching: bool = False,
    device: str = "cpu",
    ready_timeout: float = 300.0,
) -> Iterator[Served]:
    """`transformers serve` with `model_dir` preloaded, on `device`, until the block ends.

    It needs `accelerate` (transformers' `serving` extra): it always loads with a device_map.
    Requests must name the model as the path it was started with (`Served.model`), or none.
    Continuous batching applies to text-only models alone: for LLaVA it logs that it falls back to
    sequential generation, one request at a time, exactly as without the flag.
    One short request is sent before yielding, so the first measured one pays no first-call costs
    (Trident's workers are warm from their start-up profiling).
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
    peer = PeerServer(
        argv, log, url, env={"HF_HUB_OFFLINE": "1"}, warm_model=model, ready_timeout=ready_timeout
    )
    with peer_server(peer) as proc:
        yield Served(name, PEER, url, model, proc.pid, log)


# -- processes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerServer:
    """A peer's server process: its command, its log (it runs in the log's folder), its base URL
    (ready once GET /health answers 200), what is added to its environment, the model one short
    request warms it up with (None: no warm-up), and how long it may take to start and to stop."""

    argv: list[str]
    log: Path
    url: str
    env: Mapping[str, str] | None = None
    warm_model: str | None = None
    ready_timeout: float = 300.0
    stop_timeout: float = 30.0


@contextlib.contextmanager
def peer_server(peer: PeerServer) -> Iterator[subprocess.Popen[bytes]]:
    """`peer` started, ready and warm; stopped when the block ends."""
    proc = child_server.start(peer.argv, child_server.child_env(peer.env), peer.log.parent, peer.log)
    try:
        # the model loads before it listens
        child_server.wait_until_ok(f"{peer.url}/health", proc, peer.log, peer.ready_timeout)
        if peer.warm_model is not None:
            _warm_up(peer.url, peer.warm_model, peer.log, peer.ready_timeout)
        yield proc
    finally:
        child_server.stop(proc, peer.stop_timeout)


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
