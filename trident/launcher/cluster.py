"""Run a real deployment for tests: nats-server, redis-server, workers and the gateway as processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import httpx
import nats

from common.bus.subjects import Subjects
from common.compose import Method, load_compose
from common.infra import NatsServer, RedisServer, free_port
from common.roles import Role
from common.secrets import DeploymentSecrets

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
LOG_TAIL = 40  # lines of each process's log shown under a failed test


def method_workers(method: str) -> list[tuple[str, str]]:
    """(service, roles) of each worker of a method, as compose.yaml defines them: one source of truth."""
    compose = load_compose(COMPOSE, os.environ)
    return [(name, ",".join(compose.services[name].roles)) for name in compose.workers(Method(method))]


class Cluster:
    running: ClassVar[list[Cluster]] = []  # what a failed test's report shows the logs of

    def __init__(self, model: Path, workdir: Path, nats: NatsServer, redis: RedisServer) -> None:
        self.model, self.workdir, self.nats, self.redis = model, workdir, nats, redis
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            TRIDENT_MODEL=str(self.model),
            # Closed, as `trident up` runs it: the credentials come from the secrets folder.
            TRIDENT_NATS_URL=self.nats.address,
            TRIDENT_REDIS_URL=self.redis.address,
            TRIDENT_SECRETS_DIR=str(self.workdir / "secrets"),
            TRIDENT_NUM_THREADS="1",
            TRIDENT_PORT=str(self.port),
            TRIDENT_ALLOW_PRIVATE_IMAGE_URLS="0",
            TRIDENT_KV_CACHE_BYTES=str(16 << 20),
            TRIDENT_TRANSFER=os.environ.get("TRIDENT_TRANSFER", "auto"),
            TRIDENT_HEARTBEAT_TTL="3",
            TRIDENT_PROFILE_REPEATS="1",  # start-up profiling of the tiny model: well under a second
            TRIDENT_CHECK_INTEGRITY="1",  # every worker checks its ledger against its engine
        )
        env.update(extra)
        return env

    def start(self, name: str, module: str, **extra: str) -> None:
        log = open(self.workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module], env=self.env(**extra), stdout=log, stderr=subprocess.STDOUT
        )

    def start_method(
        self, method: str, scale: dict[str, int] | None = None, env: dict[str, str] | None = None
    ) -> None:
        for name, roles in method_workers(method):
            for i in range((scale or {}).get(name, 1)):
                self.start(f"{name}-{i}", "services.worker", TRIDENT_ROLES=roles, **(env or {}))
        self.start("gateway", "services.gateway", **(env or {}))

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the gateway answers /ready. Start-up is each process importing torch and
        transformers, loading and profiling the model: ~10 s on a quiet machine, and past 90 s on a
        busy one, where a shorter bound failed tests that had nothing wrong."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("cluster not ready:\n" + "\n".join(self.log(n)[-1500:] for n in self.procs))

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()

    def tails(self) -> str:
        """The end of every process's log: what a failed test prints, so that a CI failure says why."""
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

    def stop(self, name: str | None = None, timeout: float = 20.0) -> None:
        """SIGTERM to one process, or to all at once (they drain side by side), then wait for each."""
        procs = [self.procs.pop(n) for n in ([name] if name else list(self.procs))]
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
    scale: dict[str, int] | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 90.0,
):
    secrets = DeploymentSecrets.ensure(workdir / "secrets")
    with (
        NatsServer(workdir=workdir / "nats", token=secrets.nats_token) as nats,
        RedisServer(workdir=workdir / "redis", password=secrets.redis_password) as redis,
    ):
        cluster = Cluster(model, workdir, nats, redis)
        Cluster.running.append(cluster)
        try:
            cluster.start_method(method, scale, env)
            cluster.wait_ready(ready_timeout)
            try:
                yield cluster
            except BaseException as exc:  # a test that runs its own deployment failed: say why
                exc.add_note(cluster.tails())
                raise
            cluster.stop()  # drains: each worker checks its integrity once more when it is empty
            assert not cluster.integrity_failures(), "\n".join(cluster.integrity_failures())
        finally:
            Cluster.running.remove(cluster)
            cluster.stop()
