"""A running `trident up`: the local servers, the service processes, readiness, supervision and shutdown."""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from common.certs import issue
from common.compose import ComposeFile, Method
from common.infra import InfraError, LocalServer, NatsServer
from common.protocol import Plan
from common.secrets import DeploymentSecrets
from trident.launcher.follow import Change, PlanSource, change_for
from trident.launcher.processes import Child, Starter, stop_children
from trident.launcher.signal_flag import SignalFlag
from trident.launcher.specs import LocalSetup, plan, worker_spec
from trident.launcher.state import StateFile, identity
from trident.launcher.substrate import Substrate, SubstrateSetup, start_substrate

Echo = Callable[..., None]

# Proxies from the environment must not see loopback readiness probes.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True if GET `url` answers 200."""
    try:
        with _DIRECT.open(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def example_curl(base_url: str, model_name: str) -> str:
    """A chat completion request against the served model, ready to paste."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    }
    return (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )


@dataclass(frozen=True)
class UpConfig:
    """What one `trident up` runs: compose.yaml's services for a method, with replicas, on a model;
    the gateway's and the planner's ports (0: no planner port given); where its files go (`home`);
    how long start-up may take; and its options (--follow-plan, --ha, --tls)."""

    compose: ComposeFile
    method: Method
    scale: Mapping[str, int]
    model: Path
    port: int
    home: Path
    ready_timeout: float = 120.0
    planner_port: int = 0
    follow_plan: bool = False
    ha: bool = False  # a NATS cluster and a Redis primary, replica and sentinels (substrate.py)
    tls: bool = False


class Deployment:
    """Starts servers, then workers, then the gateway; stops the gateway, then workers, then servers.

    The gateway goes first on the way down so the requests it holds finish on workers that still run;
    workers drain on SIGTERM. A process that dies after start-up is restarted as compose would
    (`restart: unless-stopped`, with back-off). SIGINT/SIGTERM stop it all; a second one kills.
    With `follow_plan`, the workers follow the plan the planner's launcher actuator publishes (follow.py).
    """

    def __init__(self, config: UpConfig, echo: Echo = typer.echo, starter: Starter | None = None) -> None:
        self.config = config
        self.method = config.method  # what runs now: a plan the launcher follows may change it
        self.logs = config.home / "logs"
        self.echo = echo
        self.url = f"http://127.0.0.1:{config.port}"
        planner = config.compose.planner and config.planner_port
        self.planner_url = f"http://127.0.0.1:{config.planner_port}" if planner else None
        self.starter = starter  # how a service process starts (processes.py; None: a bare interpreter)
        self._plans: PlanSource | None = None
        self._applied = 0  # decision id of the last plan acted on
        self._pending: tuple[list[Child], list[Child], float] | None = None  # (started, to retire, deadline)
        self._retiring: dict[str, float] = {}  # child name -> monotonic time it was sent SIGTERM
        self._killed: set[str] = set()
        self._next_follow = 0.0
        self.state = StateFile(config.home / "up.json")
        self.substrate = Substrate()
        # Made once per home and kept: NATS and Redis ask for them, and so does every transfer port.
        self.secrets_dir = config.home / "secrets"
        self.secrets = DeploymentSecrets.ensure(self.secrets_dir)
        # A private CA of this run's own, and the certificate every process shows (common/certs.py).
        self.tls = issue(self.secrets_dir / "tls") if config.tls else None
        self.children: list[Child] = []
        self._stop = SignalFlag()  # set by SIGINT/SIGTERM: no threading.Event (see signal_flag.py)
        self._force = SignalFlag()
        self._down: set[str] = set()  # exited and left down by their restart policy

    # -- the whole run ---------------------------------------------------------------------------
    def run(self) -> int:
        """Run until stopped; the exit code: 0 after Ctrl-C/SIGTERM/`trident down`, 1 if start-up failed."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            self._start_servers()
            self._start_children()
            failed = self._wait_ready()
            if failed is not None:
                return failed
            self._announce()
            return self._supervise()
        except InfraError as exc:
            self.echo(f"error: {exc}", err=True)
            return 1
        finally:
            self._shutdown()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    # -- start-up --------------------------------------------------------------------------------
    @property
    def servers(self) -> dict[str, LocalServer]:
        return self.substrate.servers

    def _start_servers(self) -> None:
        try:
            setup = SubstrateSetup(self.config.home, self.logs, self.secrets, self.config.ha, self.tls)
            start_substrate(self.substrate, self.config.compose.servers, setup, self.echo)
        finally:
            self._write_state()  # `trident down` must find what started, even if the rest did not

    def _start_children(self) -> None:
        planner_env: dict[str, str] = {}
        if self.config.planner_port:
            planner_env["TRIDENT_HTTP_PORT"] = str(self.config.planner_port)
        if self.config.follow_plan:
            planner_env["TRIDENT_PLANNER_ACTUATOR"] = "launcher"
        board = (self.config.home / "cores.board").resolve()
        board.unlink(missing_ok=True)  # this deployment's workers only
        self.setup = LocalSetup(
            model=self.config.model,
            port=self.config.port,
            hosts=self.substrate.hosts,
            urls=self.substrate.urls,
            substrate_env=self.substrate.env,
            cpus=len(os.sched_getaffinity(0)),
            user_env=os.environ,
            secrets_dir=self.secrets_dir.resolve(),
            core_board=board,
            service_env={self.config.compose.planner: planner_env} if self.config.compose.planner else {},
        )
        for spec in plan(self.config.compose, self.method, self.config.scale, self.setup):
            self._start_child(Child(spec, self.logs, os.environ, self.starter))
        self._write_state()

    def _start_child(self, child: Child) -> None:
        child.start()
        self.children.append(child)
        spec = child.spec
        threads = spec.env.get("TRIDENT_NUM_THREADS", os.environ.get("TRIDENT_NUM_THREADS", "default"))
        roles = f" ({','.join(spec.roles)}; torch threads: {threads})"
        self.echo(f"{spec.name}: pid {child.pid}{roles if spec.roles else ''}, log {child.log_path}")

    def _wait_ready(self) -> int | None:
        """None once the gateway is ready, else the exit code (0 if stopped meanwhile, 1 on failure)."""
        self.echo(f"waiting for {self.url}/ready (up to {self.config.ready_timeout:.0f} s)")
        deadline = time.monotonic() + self.config.ready_timeout
        while not self._stop.is_set():
            for child in self.children:
                if not child.running:
                    self.echo(
                        f"error: {child.name} exited (code {child.returncode}) during start-up", err=True
                    )
                    self.echo(f"--- last lines of {child.log_path}:\n{child.log_tail()}", err=True)
                    return 1
            if http_ok(f"{self.url}/ready"):
                return None
            if time.monotonic() >= deadline:
                gateway = next(c for c in self.children if c.spec.gateway)
                self.echo(
                    f"error: the gateway was not ready after {self.config.ready_timeout:.0f} s", err=True
                )
                self.echo(f"--- last lines of {gateway.log_path}:\n{gateway.log_tail()}", err=True)
                return 1
            self._stop.wait(0.25)
        return 0

    def _announce(self) -> None:
        model_name = os.environ.get("TRIDENT_MODEL_NAME") or self.config.model.name
        self.echo(f"gateway: {self.url}")
        if self.planner_url:
            following = " (trident up follows its plans)" if self.config.follow_plan else ""
            self.echo(f"planner: {self.planner_url}/plan{following}")
            self.echo(f"  its writes take the key in {self.secrets_dir / 'planner-key'}")
        self.echo(f"try: {example_curl(self.url, model_name)}")
        self.echo(f"logs in {self.logs}/, state in {self.state.path}; stop with Ctrl-C or `trident down`")

    # -- while running ---------------------------------------------------------------------------
    def _supervise(self) -> int:
        if self.config.follow_plan:
            namespace = os.environ.get("TRIDENT_NAMESPACE") or "trident"
            self._plans = PlanSource(self.substrate.redis_url, namespace, self.tls)
        try:
            while not self._stop.wait(0.25):
                for name, server in self.servers.items():
                    if not server.running:
                        self.echo(
                            f"{name} exited; restarting it on port {server.port} (log {server.log_path})"
                        )
                        server.start()
                        self._write_state()  # `trident down` and a later `trident up` must see the new pid
                        self.echo(f"{name}: restarted, pid {server.pid}")
                now = time.monotonic()
                self._restart_children(now)
                if self._plans is not None and now >= self._next_follow:
                    self._next_follow = now + 1.0
                    self._follow(now)
                self._reap_retired(now)
        finally:
            if self._plans is not None:
                self._plans.close()
        return 0

    # -- following the planner -------------------------------------------------------------------
    def _follow(self, now: float) -> None:
        assert self._plans is not None
        plan_ = self._plans.latest()
        if plan_ is not None and plan_.decision_id > self._applied:
            self._applied = plan_.decision_id
            try:
                self._apply(plan_, now)
            except ValueError as exc:
                self.echo(f"plan {plan_.decision_id}: cannot apply it: {exc}", err=True)
        if self._pending is not None:
            started, retire, deadline = self._pending
            live = self._plans.live_pids()
            if now >= deadline or all(c.pid in live or not c.running for c in started):
                self._pending = None
                for child in retire:
                    self._retire(child, now)

    def _apply(self, plan_: Plan, now: float) -> None:
        workers = set(self.config.compose.all_workers)
        busy = {c.name for c in self._pending[1]} if self._pending else set()
        active = [
            c
            for c in self.children
            if c.spec.service in workers and c.name not in self._retiring and c.name not in busy
        ]
        used: dict[str, set[int]] = {}
        for c in self.children:
            used.setdefault(c.spec.service, set()).add(int(c.name.rsplit("-", 1)[1]))
        change: Change = change_for(self.config.compose, plan_, active, used)
        label = ", ".join(f"{n} {s}" for s, n in change.counts.items())
        if change.empty:
            self.echo(f"plan {plan_.decision_id} ({plan_.method}: {label}): already running")
            return
        self.echo(f"plan {plan_.decision_id} ({plan_.method}: {label}): applying")
        self.method = change.method
        total = sum(change.counts.values())
        started = []
        for service, index in change.start:
            child = Child(
                worker_spec(self.config.compose, service, index, self.setup, total),
                self.logs,
                os.environ,
                self.starter,
            )
            self._start_child(child)
            started.append(child)
        self._write_state()
        previous = self._pending[1] if self._pending else []
        self._pending = (started, previous + change.retire, now + self.config.ready_timeout)
        if change.retire:
            names = ", ".join(c.name for c in change.retire)
            self.echo(f"will drain {names} once the new replicas are registered")

    def _retire(self, child: Child, now: float) -> None:
        self.echo(f"{child.name}: draining (SIGTERM)")
        child.restart_at = None
        child.signal(signal.SIGTERM)
        self._retiring[child.name] = now

    def _reap_retired(self, now: float) -> None:
        for child in [c for c in self.children if c.name in self._retiring]:
            if not child.running:
                if child.proc is not None:
                    child.proc.wait()
                self.children.remove(child)
                del self._retiring[child.name]
                self._killed.discard(child.name)
                self._write_state()  # before saying so, as for a restart
                self.echo(f"{child.name}: stopped (code {child.returncode})")
            elif now - self._retiring[child.name] >= child.spec.stop_grace and child.name not in self._killed:
                self._killed.add(child.name)
                self.echo(f"{child.name} did not drain in {child.spec.stop_grace:.0f} s; killed")
                child.signal(signal.SIGKILL)

    def _restart_children(self, now: float) -> None:
        for child in self.children:
            if child.name in self._retiring:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                    self._write_state()  # before saying so: `trident down` must see the new pid
                    self.echo(f"{child.name}: restarted, pid {child.pid}")
            elif not child.running and child.name not in self._down:
                code = child.returncode
                delay = child.schedule_restart(now)
                if delay is None:
                    self._down.add(child.name)
                    self.echo(f"{child.name} exited with code {code}; restart policy {child.spec.restart!r}")
                else:
                    self.echo(f"{child.name} exited with code {code}; restarting in {delay:.1f} s")
                self.echo(f"--- last lines of {child.log_path}:\n{child.log_tail(10)}")

    # -- shutdown --------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        if any(c.running for c in self.children):
            self.echo("stopping: the gateway, then the workers (they drain; Ctrl-C again to kill)")

        def killed(child: Child) -> None:
            self.echo(f"{child.name} did not stop in {child.spec.stop_grace:.0f} s; killed")

        gateway = [c for c in self.children if c.spec.gateway]
        stop_children(gateway, self._force.is_set, killed)
        stop_children([c for c in self.children if not c.spec.gateway], self._force.is_set, killed)
        self.substrate.stop()
        self.state.remove()
        if self.children or self.servers:
            self.echo("stopped")

    def _write_state(self) -> None:
        state: dict[str, Any] = {
            **identity(os.getpid()),  # this process: its argv as /proc shows it
            "method": self.method.value,
            "gateway": self.url,
            "port": self.config.port,
            "planner": self.planner_url,
            "follow_plan": self.config.follow_plan,
            "model": str(self.config.model),
            "compose": str(self.config.compose.path.resolve()),
            "logs": str(self.logs.resolve()),
            "secrets": str(self.secrets_dir.resolve()),  # the servers' credentials (common/secrets.py)
            "servers": {
                name: {
                    **identity(s.pid, s.command),
                    "url": s.address,
                    "port": s.port,
                    **({"monitor": s.monitor_port} if isinstance(s, NatsServer) else {}),
                    "log": str(s.log_path.resolve()),
                }
                for name, s in self.servers.items()
            },
            "processes": [
                {
                    "name": c.name,
                    "service": c.spec.service,
                    "roles": list(c.spec.roles),
                    **identity(c.pid, c.spec.argv),
                    "stop_grace": c.spec.stop_grace,
                    "log": str(c.log_path.resolve()),
                }
                for c in self.children
            ],
        }
        self.state.write(state)
