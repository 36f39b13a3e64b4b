"""Runs inside the infra namespace for test_three_hosts.py: nats-server, redis-server and the gateway
here, the EP worker and the decoder in their own namespaces, each bound to its namespace's one
address; then asks the gateway, and prints one JSON line (the answers, the instances, the
decoder's metrics) for the test to check.

    ip netns exec <infra> python -m tests.services.three_hosts_driver '<spec JSON>'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common.certs import issue
from common.infra import NatsServer, RedisServer, free_port
from common.secrets import DeploymentSecrets, operator_header


def main(spec: dict) -> dict:
    workdir, address, names = Path(spec["workdir"]), spec["address"], spec["names"]
    secrets = DeploymentSecrets.ensure(workdir / "secrets")
    host = address["infra"]
    # "tls": the TCP backend, and every channel between the hosts over mutual TLS.
    tls = issue(workdir / "tls", address.values()) if spec["transfer"] == "tls" else None
    with (
        NatsServer(workdir=workdir / "nats", host=host, token=secrets.nats_token, tls=tls) as nats,
        RedisServer(workdir=workdir / "redis", host=host, password=secrets.redis_password, tls=tls) as redis,
    ):
        port = free_port(host)
        base = {
            **os.environ,
            "TRIDENT_MODEL": spec["model"],
            "TRIDENT_NATS_URL": nats.address,
            "TRIDENT_REDIS_URL": redis.address,
            "TRIDENT_SECRETS_DIR": str(workdir / "secrets"),
            "TRIDENT_TRANSFER": "tcp" if tls is not None else spec["transfer"],
            **({"TRIDENT_TLS_DIR": str(tls.folder)} if tls is not None else {}),
            "TRIDENT_PORT": str(port),
            "TRIDENT_NUM_THREADS": "1",
            "TRIDENT_KV_CACHE_BYTES": str(16 << 20),
            "TRIDENT_PROFILE_REPEATS": "1",
            # Every tensor by handle over the transfer port, none inline in a NATS message.
            "TRIDENT_TRANSFER_INLINE_MAX_BYTES": "0",
            # UCX over TCP only: no shared memory or cross-memory attach between the "hosts".
            "UCX_TLS": "tcp,self",
        }
        running: dict[str, subprocess.Popen] = {}
        try:
            start_services(running, base, address, names, workdir)
            url = f"http://{host}:{port}"
            _wait_ready(url, running, workdir)
            verify = tls.client_context() if tls is not None else True
            with httpx.Client(timeout=120, trust_env=False, verify=verify) as http:
                answers = []
                for messages in spec["messages"]:
                    body = {"model": "tiny-llava", "messages": messages, "max_tokens": 16, "temperature": 0}
                    reply = http.post(url + "/v1/chat/completions", json=body)
                    reply.raise_for_status()
                    answers.append(reply.json()["choices"][0]["message"]["content"])
                operator = operator_header(workdir / "secrets")
                instances = http.get(url + "/v1/cluster", headers=operator).json()["instances"]
                decoder = next(i for i in instances if i["roles"] == ["decode"])
                metrics = http.get(decoder["http_address"] + "/metrics").text
            return {"answers": answers, "instances": instances, "decoder_metrics": metrics, "gateway": url}
        finally:
            stop_all(running)


SERVICES = {  # name: (module, host, environment of its own)
    "gateway": ("services.gateway", "infra", {}),
    "worker-ep": ("services.worker", "ep", {"TRIDENT_ROLES": "encode,prefill"}),
    "decode": ("services.worker", "d", {"TRIDENT_ROLES": "decode"}),
}


def start_services(
    running: dict[str, subprocess.Popen], base: dict, address: dict, names: dict, workdir: Path
) -> None:
    """The gateway here (infra), the EP worker and the decoder on their own hosts, each bound to its
    host's one address, logging to `workdir/<name>.log`; into `running` as each starts."""
    for name, (module, host, extra) in SERVICES.items():
        env = {**base, **extra, "TRIDENT_BIND_HOST": address[host], "TRIDENT_ADVERTISE_HOST": address[host]}
        argv = [sys.executable, "-m", module]
        if host != "infra":
            argv = ["ip", "netns", "exec", names[host], *argv]
        log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        running[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to each (they drain), then SIGKILL to any still there after 30 s."""
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(url: str, procs: dict, workdir: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited {proc.returncode}: {(workdir / f'{name}.log').read_text()[-2000:]}"
                )
        try:
            if httpx.get(url + "/ready", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    logs = "\n".join((workdir / f"{n}.log").read_text()[-1500:] for n in procs)
    raise TimeoutError(f"not ready in {timeout:.0f} s:\n{logs}")


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
