"""What a running deployment shows of itself, read from outside as an operator would:
where its requests' time went (the stage marks of their Redis trace records), what each transfer
moved and how fast (the pulling workers' Prometheus histograms), each process's memory (RSS from
/proc; GPU memory from the workers' own figures and nvidia-smi), and which transfer path each
worker took (its registered transfer address). bench/gpu_serve.py records these per deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from common.secrets import operator_header
from common.stats import quantile
from common.store import Store, StoreConfig
from trident.launcher.local_up import rss_bytes

if TYPE_CHECKING:
    from trident.launcher.cluster import Cluster

# (name, from mark, to mark) of each part of a request's path, as common/store/requests.py marks it.
SPANS = (
    ("encode", "encode_started", "encode_ended"),
    ("ep_transfer", "ep_transfer_started", "ep_transfer_ended"),
    ("prefill", "prefill_started", "first_token"),
    ("pd_transfer", "pd_transfer_started", "pd_transfer_ended"),
    ("decode", "decode_started", "end"),
)
HOPS = ("ep", "pd")  # features encode→prefill, KV prefill→decode (services/worker/stage_metrics.py)
WORKER_FIGURES = (
    "kv_cache_bytes",
    "device_memory_allocated_bytes",
    "device_memory_reserved_bytes",
    "device_memory_peak_bytes",
)


@dataclass(frozen=True)
class View:
    """A running deployment as an operator reaches it: its gateway, its secrets (for the operator's
    view of /v1/cluster), its Redis, and the pid of each of its processes by name."""

    url: str
    secrets: Path
    redis_url: str  # with the password
    pids: dict[str, int]

    @classmethod
    def of(cls, cluster: Cluster) -> View:
        pids = {name: child.pid for name, child in cluster.children.items() if child.pid}
        pids |= {"nats": cluster.nats.pid, "redis": cluster.redis.pid}
        assert cluster.setup.secrets_dir is not None
        return cls(cluster.url, cluster.setup.secrets_dir, cluster.redis.url, pids)

    def instances(self) -> list[dict]:
        """The registered instances with their addresses (the operator's view of /v1/cluster)."""
        answer = httpx.get(self.url + "/v1/cluster", headers=operator_header(self.secrets), timeout=10)
        return answer.json()["instances"]

    def traces(self) -> list:
        """Every finished request's trace record so far."""

        async def read() -> list:
            store = await Store.connect(StoreConfig(url=self.redis_url))
            try:
                records, after = [], "-"
                while batch := await store.requests.trace(after=after, count=1000):
                    after = batch[-1][0]
                    records += [r for _, r in batch]
                return records
            finally:
                await store.close()

        return asyncio.run(read())


def stage_times(records: Sequence) -> dict:
    """p50 and p90 (ms) of each span over the requests that passed it, and of the gateway's TTFT."""
    out: dict = {}
    for name, start, end in SPANS:
        spans = [r.stages[end] - r.stages[start] for r in records if start in r.stages and end in r.stages]
        out[name] = _ms(spans)
    out["ttft"] = _ms([r.ttft for r in records if r.ttft is not None])
    return out


def transfer_shares(records: Sequence) -> dict[str, float | None]:
    """Per hop, the median over requests of its transfer's time as a share of the request's TTFT
    (E→P is inside the TTFT; P→D comes after the first token, before the second)."""
    out = {}
    for hop in HOPS:
        start, end = f"{hop}_transfer_started", f"{hop}_transfer_ended"
        shares = [
            (r.stages[end] - r.stages[start]) / r.ttft
            for r in records
            if start in r.stages and end in r.stages and r.ttft
        ]
        out[hop] = round(quantile(shares, 0.5), 5) if shares else None
    return out


def _ms(values: Sequence[float]) -> dict:
    if not values:
        return {"count": 0, "p50_ms": None, "p90_ms": None}
    return {
        "count": len(values),
        "p50_ms": round(quantile(values, 0.5) * 1000, 3),
        "p90_ms": round(quantile(values, 0.9) * 1000, 3),
    }


def scrape(address: str) -> dict[str, float]:
    """A worker's /metrics, as {sample name with labels stripped: summed value}."""
    text = httpx.get(address.rstrip("/") + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def transfers(scraped: Iterable[dict[str, float]]) -> dict:
    """Per hop, over every pulling worker: pulls, bytes (all and per pull) and GB/s (bytes over the
    pulls' summed time; inline tensors count as bytes moved in no time)."""
    totals: dict = {}
    for hop in HOPS:
        seconds = sum(m.get(f"trident_{hop}_transfer_seconds_sum", 0.0) for m in scraped)
        nbytes = sum(m.get(f"trident_{hop}_transfer_bytes_sum", 0.0) for m in scraped)
        count = sum(m.get(f"trident_{hop}_transfer_bytes_count", 0.0) for m in scraped)
        totals[hop] = {
            "pulls": int(count),
            "bytes": int(nbytes),
            "bytes_per_pull": int(nbytes / count) if count else None,
            "seconds": round(seconds, 6),
            "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
        }
    return totals


def gpu_memory_by_pid() -> dict[int, int] | None:
    """Each process's GPU memory as nvidia-smi counts it (bytes; the CUDA context included); None
    where there is no nvidia-smi or it does not answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    argv = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        run = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
        rows = [line.split(",") for line in run.stdout.splitlines() if line.strip()]
        return {int(pid): int(float(mib)) << 20 for pid, mib in rows}
    return None


def processes(view: View, instances: list[dict], scraped: dict[str, dict]) -> dict:
    """Every server's and service's memory: RSS, nvidia-smi's GPU bytes, and a worker's own figures
    (KV cache, torch's device memory: absent on a CPU, so null)."""
    on_gpu = gpu_memory_by_pid()
    by_pid = {int(i["instance_id"].rsplit("-", 1)[1]): i["instance_id"] for i in instances}
    out = {}
    for name, pid in view.pids.items():
        figures = scraped.get(by_pid.get(pid, ""), {})
        out[name] = {
            "pid": pid,
            "rss_bytes": rss_bytes(pid),
            "gpu_bytes": None if on_gpu is None else on_gpu.get(pid, 0),
            **{figure: _int(figures.get(f"trident_{figure}")) for figure in WORKER_FIGURES},
        }
    return out


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def observe(view: View) -> dict:
    """Everything above, read now (after the load has finished)."""
    instances = view.instances()
    scraped = {i["instance_id"]: scrape(i["http_address"]) for i in instances if i.get("http_address")}
    records = view.traces()
    return {
        "requests_traced": len(records),
        "stages": stage_times(records),
        "transfers": transfers(scraped.values()) | {"share_of_ttft_p50": transfer_shares(records)},
        "transfer_paths": {i["instance_id"]: i["transfer_address"].split("://", 1)[0] for i in instances},
        "processes": processes(view, instances, scraped),
    }
