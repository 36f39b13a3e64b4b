"""`trident up` run as a child process, as a user runs it: the one way the benchmarks and the tests
start it (trident/bench/deployments.py for the systems `trident bench compare` measures, bench/faults.py
and bench/overload.py for the processes they act on).

It runs in `workdir`: the state file `trident up` writes there (`.trident/up.json`) names the pid of
every server and service, and its NATS/Redis data and the services' logs (`.trident/logs/`) stay apart
from any other `trident up` on the machine; the gateway's `/v1/cluster` lists the registered
instances, whose ids end in their pid.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from common.compose import Method, load_compose
from common.infra import free_port
from common.infra.ha import stream_leader
from common.models import resolve_model
from common.secrets import operator_header
from common.tls import Tls
from trident.launcher import child_server
from trident.launcher.state import STATE, StateFile, clear_leftovers

COMPOSE = child_server.REPO / "compose.yaml"
LOG = "trident-up.log"  # in the working directory, beside the services' own logs under .trident/logs
# `trident` is the console script for trident.cli.app:app; this runs the same app with this interpreter.
_TRIDENT_MAIN = "from trident.cli.app import app; app(prog_name='trident')"


def model_or_tiny(model: Path | None, workdir: Path) -> Path:
    """`model` (a directory or a preset name), or the tiny model, a preset written under `workdir/models`
    on first use (a complete one is reused)."""
    return resolve_model(model, workdir / "models")


@dataclass(frozen=True)
class UpCommand:
    """What `trident up` is asked to run, and where. `env` is added to this process's environment,
    and the services get it under compose.yaml's own (TRIDENT_POLICY, TRIDENT_PREFETCH... reach every
    worker)."""

    model: Path
    workdir: Path
    method: str = Method.E_P_D.value
    scale: Mapping[str, int] = field(default_factory=dict)  # compose service -> replicas
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0  # the gateway's; 0: a free one
    ha: bool = False
    tls: bool = False
    ready_timeout: float | None = None  # `trident up --ready-timeout`; None: its default

    def argv(self, port: int, planner_port: int) -> list[str]:
        argv = [
            *(sys.executable, "-c", _TRIDENT_MAIN, "up", "--file", str(COMPOSE)),
            *("--model", str(Path(self.model).resolve()), "--method", self.method),
            *("--port", str(port), "--planner-port", str(planner_port)),
            *(f"--scale={service}={n}" for service, n in self.scale.items()),
        ]
        if self.ready_timeout is not None:
            argv += ["--ready-timeout", str(self.ready_timeout)]
        return argv + (["--ha"] if self.ha else []) + (["--tls"] if self.tls else [])


class LocalUp:
    """`trident up` as a child process, read through its state file and its gateway."""

    def __init__(self, command: UpCommand) -> None:
        Method(command.method)  # ValueError for an unknown method, before anything starts
        self.workdir = Path(command.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.scale = dict(command.scale)
        # Each scaled service's roles, as compose.yaml gives them (TRIDENT_ROLES).
        services = load_compose(COMPOSE, os.environ).services
        self.roles = {name: frozenset(services[name].roles) for name in self.scale}
        self.port = command.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        planner_port = free_port()
        self.planner_url = f"http://127.0.0.1:{planner_port}"
        self.log = self.workdir / LOG
        argv = command.argv(self.port, planner_port)
        self.proc = child_server.start(argv, child_server.child_env(command.env), self.workdir, self.log)

    def wait_ready(self, timeout: float) -> None:
        """Until the gateway's /ready answers 200; raises if `trident up` exits first or `timeout` passes."""
        child_server.wait_until_ok(f"{self.url}/ready", self.proc, self.log, timeout)

    def state(self) -> dict:
        try:
            return json.loads((self.workdir / STATE).read_text())
        except (OSError, ValueError):
            return {}

    def cluster(self) -> list[dict]:
        """Every registered instance, addresses included (the operator's view of /v1/cluster)."""
        operator = operator_header(Path(self.state()["secrets"]))
        return httpx.get(self.url + "/v1/cluster", headers=operator, timeout=5).json()["instances"]

    @property
    def tls(self) -> Tls | None:
        """With --tls: the certificate the deployment's processes show (a member's)."""
        folder = Path(self.state()["secrets"]) / "tls"
        return Tls.at(folder) if (folder / "ca.pem").exists() else None

    def instances(self, role: str) -> list[dict]:
        return [i for i in self.cluster() if role in i["roles"]]

    def whole(self) -> bool:
        """The gateway is ready and as many of each stage are registered as were asked for."""
        try:
            if httpx.get(self.url + "/ready", timeout=2).status_code != 200:
                return False
            found = httpx.get(self.url + "/v1/cluster", timeout=5).json()["instances"]
            running = [frozenset(i["roles"]) for i in found]
            return all(running.count(self.roles[s]) == n for s, n in self.scale.items())
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def wait_whole(self, timeout: float) -> float:
        """Seconds it took to be whole again; raises if it is not within `timeout`."""
        start = time.monotonic()
        while not self.whole():
            if self.proc.poll() is not None:
                raise RuntimeError(f"trident up exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the deployment was not whole again after {timeout:.0f} s")
            time.sleep(0.25)
        return time.monotonic() - start

    def pid(self, service: str) -> int:
        """The pid of a server (nats, redis) or of the gateway."""
        state = self.state()
        if service in state.get("servers", {}):
            return int(state["servers"][service]["pid"])
        return next(int(p["pid"]) for p in state["processes"] if p["service"] == service)

    def stream_leader(self) -> int:
        """With --ha: the pid of the NATS node that leads the task stream."""
        nodes = {n: s for n, s in self.state()["servers"].items() if "monitor" in s}
        leader = stream_leader(f"http://127.0.0.1:{node['monitor']}" for node in nodes.values())
        if leader not in nodes:
            raise RuntimeError("no NATS node names a leader of the task stream")
        return int(nodes[leader]["pid"])

    def redis_primary(self) -> int:
        """With --ha: the pid of the Redis node the sentinels name the primary."""
        state = self.state()
        password = (Path(state["secrets"]) / "redis-password").read_text().strip()
        nodes = {int(s["port"]): int(s["pid"]) for n, s in state["servers"].items() if n.startswith("redis-")}
        for name, server in state["servers"].items():
            if not name.startswith("sentinel-"):
                continue
            client = redis.Redis(port=int(server["port"]), password=password, socket_timeout=2)
            try:
                found = client.sentinel_get_master_addr_by_name("trident")
            except redis.RedisError:
                continue
            finally:
                client.close()
            if found and int(found[1]) in nodes:
                return nodes[int(found[1])]
        raise RuntimeError("no sentinel names a Redis primary")

    def processes(self) -> dict[str, int]:
        """Every server's and service's pid, by name (nats, redis, gateway-1, decode-1, ...)."""
        return state_processes(self.state())

    def busy_worker(self, role: str) -> int:
        """The pid of an instance of `role`, one that holds requests if there is one."""
        found = self.instances(role)
        for inst in found:
            if metric(inst["http_address"], "trident_held_requests", self.tls) > 0:
                return _pid(inst)
        return _pid(found[0])

    def stop(self, timeout: float = 120.0) -> None:
        """SIGINT (it drains its services in order), then harder (child_server.stop); then whatever a
        `trident up` that was killed or crashed left running, as `trident down` clears it."""
        child_server.stop(self.proc, timeout)
        state_file = StateFile(self.workdir / STATE)
        state = state_file.read()
        if state is not None:  # a clean stop removes it
            clear_leftovers(state)
            state_file.remove()


def state_processes(state: dict) -> dict[str, int]:
    """The pid of every server and service in `trident up`'s state file, by name."""
    found = {name: int(s["pid"]) for name, s in state.get("servers", {}).items()}
    found.update({p["name"]: int(p["pid"]) for p in state.get("processes", [])})
    return found


def _pid(instance: dict) -> int:
    return int(instance["instance_id"].rsplit("-", 1)[1])


def metric(base_url: str, name: str, tls: Tls | None = None) -> float:
    """The sum of a Prometheus metric's samples on one service (0 when it has none); `tls`: the
    deployment's, which a worker's HTTPS asks for."""
    verify = tls.client_context() if tls is not None else True
    text = httpx.get(base_url + "/metrics", timeout=5, verify=verify).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
