"""Looking into a running deployment from a test: a service's Prometheus metrics, the instances the
gateway lists, an instance's process, its Redis, and waiting (with a bound) for a condition."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.store import Store, StoreConfig


def metric(base_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples on one service (every line that starts with `name`)."""
    total = 0.0
    for line in httpx.get(base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(base_url: str) -> dict[str, float]:
    """Every sample on one service's /metrics, summed over labels other than `kind`."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=5).text):
        for s in family.samples:
            name = s.name + (f"{{{s.labels['kind']}}}" if "kind" in s.labels and "le" not in s.labels else "")
            if "le" not in s.labels:
                samples[name] = samples.get(name, 0.0) + s.value
    return samples


def added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each sample grew by between two scrapes."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def instances(cluster, role: str) -> list[dict]:
    """The registered instances that run `role`, addresses included."""
    return [i for i in cluster.instances() if role in i["roles"]]


def pid_of(instance: dict) -> int:
    return int(instance["instance_id"].rsplit("-", 1)[1])


def held(instance: dict) -> float:
    """How many requests the instance holds now."""
    return metric(instance["http_address"], "trident_held_requests")


def wait_for(check, timeout: float = 30.0, what: str = "") -> None:
    """Until `check()` is true; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached in time: {what or check}"
        time.sleep(0.05)


def draining(instance: dict, timeout: float = 10.0) -> None:
    """Wait until the instance says it drains (its /ready answers 503) or is gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(instance["http_address"] + "/ready", timeout=5).status_code == 503:
                return
        except httpx.HTTPError:
            return
        assert time.monotonic() < deadline, f"{instance['instance_id']} did not start draining"
        time.sleep(0.02)


def read_store(cluster, read):
    """One read of the cluster's Redis, from a (synchronous) test."""

    async def main():
        store = await Store.connect(StoreConfig(url=cluster.redis.url))
        try:
            return await read(store)
        finally:
            await store.close()

    return asyncio.run(main())


def prefix_routes(cluster, reason: str) -> float:
    """How many requests the gateway sent where their prefix is cached, for `reason`."""
    return metric(cluster.url, f'trident_gateway_prefix_routes_total{{reason="{reason}"}}')
