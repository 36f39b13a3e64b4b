"""One source for the substrate's settings (common/infra/settings.py): `trident up`'s servers
(common/infra), compose.yaml, compose.ha.yaml, compose.tls.yaml and the Kubernetes manifests all run
NATS and Redis with the same payload limit, stream copies, sentinel timeouts and images."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from common.infra import NatsServer
from common.infra.ha import RedisGroup
from common.infra.settings import (
    NATS,
    NATS_COMPOSE_IMAGE,
    NATS_IMAGE,
    REDIS_COMPOSE_IMAGE,
    REDIS_IMAGE,
    SENTINEL,
    release_line,
)
from trident.kubernetes.render import Options, render

ROOT = Path(__file__).resolve().parents[2]
# NATS's config units: a `b` suffix counts in 1024s, a bare letter in 1000s (8MB = 8 MiB).
UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text.strip()).groups()
    return int(number) * UNITS[unit.lower()]


def compose(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def nats_payloads(text: str) -> list[int]:
    return [size(v) for v in re.findall(r"^\s*max_payload:\s*(\S+)\s*$", text, re.M)]


def sentinel_settings(text: str) -> dict[str, int]:
    found = dict(
        re.findall(r"sentinel (down-after-milliseconds|failover-timeout|parallel-syncs) \S+ (\d+)", text)
    )
    quorum = re.search(r"sentinel monitor \S+ \S+ \d+ (\d+)", text)
    return {**{k: int(v) for k, v in found.items()}, "quorum": int(quorum[1])}


WANTED = {
    "down-after-milliseconds": SENTINEL.down_after_ms,
    "failover-timeout": SENTINEL.failover_timeout_ms,
    "parallel-syncs": SENTINEL.parallel_syncs,
    "quorum": SENTINEL.quorum,
}


def test_compose_files_run_the_substrate_with_the_shared_settings() -> None:
    single, ha, tls = compose("compose.yaml"), compose("compose.ha.yaml"), compose("compose.tls.yaml")
    assert nats_payloads(single["configs"]["nats-conf"]["content"]) == [NATS.max_payload]
    assert nats_payloads(ha["configs"]["nats-cluster-conf"]["content"]) == [NATS.max_payload]
    assert all(
        p == NATS.max_payload for c in tls.get("configs", {}).values() for p in nats_payloads(c["content"])
    )
    assert sentinel_settings(ha["configs"]["redis-sentinel-sh"]["content"]) == WANTED
    nodes = [n for n, s in ha["services"].items() if s.get("image") == NATS_COMPOSE_IMAGE]
    assert len(nodes) == NATS.cluster_nodes
    assert ha["x-ha-env"]["TRIDENT_NATS_STREAM_REPLICAS"] == str(NATS.stream_replicas)
    images = {s["image"] for f in (single, ha) for s in f["services"].values() if "image" in s}
    # The compose files run the release line of the exact tags the clusters pin.
    assert (release_line(NATS_IMAGE), release_line(REDIS_IMAGE)) == (NATS_COMPOSE_IMAGE, REDIS_COMPOSE_IMAGE)
    assert {NATS_COMPOSE_IMAGE, REDIS_COMPOSE_IMAGE} <= images
    substrate = (NATS_COMPOSE_IMAGE, REDIS_COMPOSE_IMAGE)
    assert not [i for i in images if i.startswith(("nats:", "redis:")) and i not in substrate]


def test_trident_up_runs_the_substrate_with_the_shared_settings(tmp_path: Path) -> None:
    server = NatsServer(workdir=tmp_path / "nats")
    server.monitor_port = 8222
    assert nats_payloads(server._config()) == [NATS.max_payload]
    group = RedisGroup(tmp_path, ["127.0.0.1"] * 3, "pw", ports=[7001, 7003, 7005])
    assert sentinel_settings(group.sentinels[0]._config()) == WANTED


def test_kubernetes_runs_the_substrate_with_the_shared_settings() -> None:
    objects = render(Options(method="ep+d"))
    config = next(o for o in objects if o["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
    assert nats_payloads(config) == [NATS.max_payload]
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    assert sets["nats"]["spec"]["replicas"] == NATS.cluster_nodes
    sentinel = sets["redis-sentinel"]["spec"]["template"]["spec"]["containers"][0]
    assert sentinel_settings(sentinel["command"][-1]) == WANTED
    images = {c["image"] for s in sets.values() for c in s["spec"]["template"]["spec"]["containers"]}
    assert images == {NATS_IMAGE, REDIS_IMAGE}
    for o in objects:
        if o["kind"] == "Deployment":
            for c in o["spec"]["template"]["spec"]["containers"]:
                assert {"name": "TRIDENT_NATS_STREAM_REPLICAS", "value": str(NATS.stream_replicas)} in c[
                    "env"
                ]
