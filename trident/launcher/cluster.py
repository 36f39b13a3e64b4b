"""A deployment under its caller's control: nats-server, redis-server and the service processes of a
method, each started from compose.yaml's spec (specs.py) as `trident up` starts it, but without its
supervision: a process that dies stays down until the caller acts. The benchmarks and the tests run
their deployments through it; `trident up` (deployment.py) adds restarts, a state file and plans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import httpx
import nats

from common.bus.subjects import Subjects
from common.compose import ComposeFile, Method, load_compose
from common.infra import NatsServer, RedisServer, free_port
from common.roles import Role
from common.secrets import DeploymentSecrets, operator_header
from trident.launcher.processes import Child, Process, Starter
from trident.launcher.specs import (
    LocalSetup,
    ProcessSpec,
    gateway_spec,
    local_argv,
    service_spec,
    worker_spec,
)

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
LOG_TAIL = 40  # lines of each process's log shown under a failure
STOP_GRACE = 20.0  # seconds a process stopped by the caller has to drain


def method_workers(method: str, compose: ComposeFile | None = None) -> list[tuple[str, str]]:
    """(service, roles) of each worker of a method, as compose.yaml defines them: one source of truth."""
    compose = compose or load_compose(COMPOSE, os.environ)
    return [(name, ",".join(compose.services[name].roles)) for name in compose.workers(Method(method))]


class Processes(Mapping[str, Process]):
    """The cluster's running processes by name, as `subprocess.Popen`-like handles; `pop` forgets one."""

    def __init__(self, children: dict[str, Child]) -> None:
        self._children = children

    def __getitem__(self, name: str) -> Process:
        proc = self._children[name].proc
        assert proc is not None
        return proc

    def __iter__(self) -> Iterator[str]:
        return iter(self._children)

    def __len__(self) -> int:
        return len(self._children)

    def pop(self, name: str) -> Process:
        proc = self[name]
        del self._children[name]
        return proc


class Cluster:
    """Service processes on a running nats-server and redis-server, started and stopped by name."""

    running: ClassVar[list[Cluster]] = []  # what a failure report shows the logs of

    def __init__(
        self,
        model: Path,
        workdir: Path,
        nats: NatsServer,
        redis: RedisServer,
        env: Mapping[str, str] | None = None,
        starter: Starter | None = None,
        compose: ComposeFile | None = None,
    ) -> None:
        self.model, self.workdir, self.nats, self.redis = model, workdir, nats, redis
        self.env = dict(env or {})  # over every process's compose environment
        self.starter = starter
        self.compose = compose or load_compose(COMPOSE, os.environ)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.method: str | None = None
        self.planner_url: str | None = None  # where a caller that starts a planner serves it
        self.setup = LocalSetup(
            model=model,
            port=self.port,
            hosts={"nats": f"{nats.host}:{nats.port}", "redis": f"{redis.host}:{redis.port}"},
            cpus=len(os.sched_getaffinity(0)),
            user_env={**os.environ, **self.env},
            secrets_dir=(workdir / "secrets").resolve(),
        )
        self.children: dict[str, Child] = {}
        self.procs = Processes(self.children)

    @property
    def operator(self) -> dict[str, str]:
        """The header under which the gateway's /v1/cluster shows where each instance listens."""
        assert self.setup.secrets_dir is not None
        return operator_header(self.setup.secrets_dir)

    def instances(self) -> list[dict]:
        """Every registered instance, addresses included, as /v1/cluster shows the operator."""
        return httpx.get(self.url + "/v1/cluster", headers=self.operator, timeout=5).json()["instances"]

    # -- starting ---------------------------------------------------------------------------------
    def start_method(self, method: str, scale: Mapping[str, int] | None = None) -> None:
        """The method's workers (one of each unless `scale` says otherwise), then the gateway."""
        workers = self.compose.workers(Method(method))
        counts = {name: (scale or {}).get(name, 1) for name in workers}
        total = sum(counts.values())
        for name, count in counts.items():
            for index in range(1, count + 1):
                self.start_spec(worker_spec(self.compose, name, index, self.setup, total))
        self.start_spec(dataclasses.replace(gateway_spec(self.compose, self.setup), name="gateway"))
        self.method = method

    def start(self, name: str, module: str, **extra: str) -> Child:
        """One more process running `python -m module`: a replica of the compose service whose
        command that is (a worker's roles, a gateway's port and so on set through `extra`)."""
        argv = local_argv(("python", "-m", module))
        services = [s for s in self.compose.services.values() if local_argv(s.command) == argv]
        if not services:
            raise ValueError(f"no service of {self.compose.path} runs `python -m {module}`")
        service = services[0]
        if service.name == self.compose.gateway:
            spec = gateway_spec(self.compose, self.setup, port=int(extra.get("TRIDENT_PORT", self.port)))
        elif service.name in self.compose.all_workers:
            spec = worker_spec(self.compose, service.name, 1, self.setup, len(self.children) + 1)
        else:
            spec = service_spec(self.compose, service.name, 1, self.setup)
        spec = dataclasses.replace(spec, name=name, restart="no")
        return self.start_spec(spec, **extra)

    def start_spec(self, spec: ProcessSpec, **extra: str) -> Child:
        spec = dataclasses.replace(spec, env={**spec.env, **self.env, **extra})
        child = Child(spec, self.workdir, os.environ, self.starter)
        sys.audit("trident.launcher.start", list(spec.argv))  # tests/tiers.py: a deployment starts
        child.start()
        self.children[spec.name] = child
        return child

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the gateway answers /ready. Start-up is each process loading and profiling the model
        (and, started plainly, importing torch and transformers first: past 90 s on a busy machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, child in self.children.items():
                if not child.running:
                    raise RuntimeError(f"{name} exited with {child.returncode}:\n{self.log(name)[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("cluster not ready:\n" + "\n".join(self.log(n)[-1500:] for n in self.children))

    # -- reading ----------------------------------------------------------------------------------
    def name_of(self, service: str) -> str:
        """The name of the (first) running process of a compose service: `decode` -> `decode-1`."""
        return next(n for n, c in self.children.items() if c.spec.service == service)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def tails(self) -> str:
        """The end of every process's log: what a failure prints, so that it says why."""
        return "\n".join(
            f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL:])
            for path in sorted(self.workdir.glob("*.log"))
        )

    def unacked_tasks(self, role: Role) -> int:
        """Tasks for `role` published and not acked yet: waiting in its queue, or taken by a worker
        that has not finished them (the work queue drops a task once it is acked)."""

        async def read() -> int:
            subjects = Subjects()
            nc = await nats.connect(self.nats.url, allow_reconnect=False)
            try:
                info = await nc.jetstream().consumer_info(subjects.task_stream, subjects.consumer(role))
                return (info.num_pending or 0) + (info.num_ack_pending or 0)
            finally:
                await nc.close()

        return asyncio.run(read())

    def integrity_failures(self) -> list[str]:
        """What workers logged of failed ledger/engine integrity checks (services/worker/ledger.py)."""
        logs = self.workdir.glob("*.log")
        return [
            line for log in logs for line in log.read_text().splitlines() if "integrity check failed" in line
        ]

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self, name: str | None = None, timeout: float = STOP_GRACE) -> None:
        """SIGTERM to one process, or to all at once (they drain side by side), then wait for each;
        SIGKILL to any still running after `timeout`."""
        procs = [self.procs.pop(n) for n in ([name] if name else list(self.children))]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def running_cluster(
    model: Path,
    workdir: Path,
    method: str,
    scale: Mapping[str, int] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 90.0,
    starter: Starter | None = None,
) -> Iterator[Cluster]:
    """A method's deployment on fresh servers of its own, ready; stopped (drained) on the way out,
    where each worker checks its ledger once more and a failed check fails the block."""
    secrets = DeploymentSecrets.ensure(workdir / "secrets")
    with (
        NatsServer(workdir=workdir / "nats", token=secrets.nats_token) as nats_server,
        RedisServer(workdir=workdir / "redis", password=secrets.redis_password) as redis_server,
    ):
        cluster = Cluster(model, workdir, nats_server, redis_server, env, starter)
        Cluster.running.append(cluster)
        try:
            cluster.start_method(method, scale)
            cluster.wait_ready(ready_timeout)
            try:
                yield cluster
            except BaseException as exc:  # say why, from the processes' side
                exc.add_note(cluster.tails())
                raise
            cluster.stop()  # drains: each worker checks its integrity once more when it is empty
            assert not cluster.integrity_failures(), "\n".join(cluster.integrity_failures())
        finally:
            Cluster.running.remove(cluster)
            cluster.stop()
