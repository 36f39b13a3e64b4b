"""Runs inside the infra namespace for test_three_hosts.py's substrate test: a NATS node, a Redis node
and a sentinel on each of the three "hosts" (common/infra/ha.py), the gateway here, the EP worker
and the decoder on the other two; then a streaming load, and under it `kill -9` of the NATS node
that leads the task stream, and later of the Redis primary. Prints one JSON line: each phase's
outcomes (how every request ended, against HF's greedy text) for the test to judge.

    ip netns exec <infra> python -m tests.services.ha_hosts_driver '<spec JSON>'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common.infra.ha import NatsCluster, RedisGroup
from common.secrets import DeploymentSecrets
from tests.services.three_hosts_driver import _wait_ready, start_services, stop_all
from trident.bench.client import image_data_url
from trident.bench.fault_load import StreamingLoad
from trident.bench.oracle import Chat, hf_greedy

HOSTS = ("infra", "ep", "d")
TOKENS = 24
WARM, AFTER = 3.0, 8.0  # seconds of load before a fault, and after it


def main(spec: dict) -> dict:
    workdir, address, names = Path(spec["workdir"]), spec["address"], spec["names"]
    secrets = DeploymentSecrets.ensure(workdir / "secrets")
    hosts = [address[h] for h in HOSTS]

    def wrap(i: int) -> list[str]:  # the infra node runs here; the others on their own hosts
        return [] if i == 0 else ["ip", "netns", "exec", names[HOSTS[i]]]

    chats = [
        Chat("Tell me a story about a lighthouse."),
        Chat("What is here?", (image_data_url(3, (64, 48)),)),
        Chat("List some things to do on a rainy day."),
    ]
    expected = hf_greedy(Path(spec["model"]), chats, TOKENS)
    with (
        NatsCluster(workdir / "nats", hosts, secrets.nats_token, ports=[4222] * 3, wrap=wrap) as nats,
        RedisGroup(workdir / "redis", hosts, secrets.redis_password, ports=[6379] * 3, wrap=wrap) as redis,
    ):
        port = 8000
        base = {
            **os.environ,
            "TRIDENT_MODEL": spec["model"],
            "TRIDENT_NATS_URL": nats.address,
            "TRIDENT_REDIS_URL": redis.address,
            "TRIDENT_NATS_STREAM_REPLICAS": "3",
            "TRIDENT_SECRETS_DIR": str(workdir / "secrets"),
            "TRIDENT_TRANSFER": "tcp",
            "TRIDENT_PORT": str(port),
            "TRIDENT_NUM_THREADS": "1",
            "TRIDENT_KV_CACHE_BYTES": str(16 << 20),
            "TRIDENT_PROFILE_REPEATS": "1",
        }
        running: dict[str, subprocess.Popen] = {}
        try:
            start_services(running, base, address, names, workdir)
            url = f"http://{address['infra']}:{port}"
            _wait_ready(url, running, workdir, timeout=180)
            load = StreamingLoad(url, "tiny-llava", chats, expected, TOKENS, 3, deadline=60.0)
            phases = {}
            for fault, victim in (("nats-node", nats.stream_leader), ("redis-primary", redis.primary_node)):
                load.start()
                time.sleep(WARM)
                node = victim()
                node.kill()
                time.sleep(AFTER)
                outcomes = load.stop()
                phases[fault] = {
                    "killed": node.name,
                    "statuses": [o.status for o in outcomes],
                    "errors": sorted({o.error for o in outcomes if o.error}),
                    "stall_s": max((o.stall for o in outcomes), default=0.0),
                }
                node.start()  # back, as a follower (NATS) or the new primary's replica (Redis)
            phases["redis-primary"]["promoted"] = redis.primary_node().name
            return {"phases": phases}
        finally:
            stop_all(running)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
