"""`trident up` run as a child process, as a user runs it, for benchmarks that act on its processes.

The state file `trident up` writes (`.trident/up.json` in its working directory) names the pid of
every server and service; the gateway's `/v1/cluster` lists the registered instances, whose ids end
in their pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from common.compose import load_compose
from common.infra import free_port
from common.infra.ha import stream_leader
from common.models import resolve_model
from common.secrets import operator_header
from common.tls import Tls

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"


def model_or_tiny(model: Path | None, workdir: Path) -> Path:
    """`model` (a directory or a preset name), or the tiny model, a preset written under `workdir/models`
    on first use (a complete one is reused)."""
    return resolve_model(model, workdir / "models")


class LocalUp:
    """`trident up` as a child process, read through its state file and its gateway."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        scale: dict[str, int],
        env: dict[str, str],
        ha: bool = False,
        tls: bool = False,
    ) -> None:
        self.workdir = workdir
        self.scale = scale
        # Each scaled service's roles, as compose.yaml gives them (TRIDENT_ROLES).
        services = load_compose(COMPOSE, os.environ).services
        self.roles = {name: frozenset(services[name].roles) for name in scale}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(Path(sys.executable).with_name("trident")), "up", "-f", str(COMPOSE),
            "--model", str(model), "--port", str(self.port), "--planner-port", str(free_port()),
            *(f"--scale={service}={n}" for service, n in scale.items()), *(["--ha"] if ha else []),
            *(["--tls"] if tls else []),
        ]  # fmt: skip
        env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        self.log = open(workdir / "up.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def state(self) -> dict:
        try:
            return json.loads((self.workdir / ".trident" / "up.json").read_text())
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
                raise RuntimeError(f"trident up exited with {self.proc.returncode}; see {self.log.name}")
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

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # a second one kills what is left
            self.proc.wait(30)
        self.log.close()


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
