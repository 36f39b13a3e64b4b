"""Checking the simulator against the real thing: run a deployment, send it a workload at a rate,
take each request's TTFT and TBT p90 as the gateway measured them (the trace), then replay the same
requests (same arrival times, prompt and output lengths) in the simulator with the profiles the
instances published and the fixed costs calibrated beforehand from unloaded requests' stage marks.

The gateway's numbers are per token; the client's are per non-empty text chunk, and a random-weight
model often emits part of a UTF-8 character, which merges two tokens into one chunk.

Compared: TTFT p50 and p90 over requests, and the median over requests of each one's TBT p90 (the
quantity the TBT SLO judges). Used by bench/planner_validation.py and tests/planner/test_validation.py.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from common.engine.loader import load_config
from common.planner.calibrate import fit_decode, fit_dispatch, jitter, stage_factors, transfer_model
from common.planner.profiles import ProfileSet, scale_profiles
from common.planner.simulator import simulate
from common.planner.trace import TraceEntry
from common.planner.types import Deployment
from common.planner.workloads import generate
from common.stats import SLO
from common.store import Store, StoreConfig

_WORDS = [
    "the",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "with",
    "red",
    "blue",
    "small",
    "large",
    "image",
    "shows",
    "what",
    "is",
    "in",
    "picture",
    "describe",
]


@dataclass
class Measured:
    """One request: sizes from the server's usage, arrival as actually sent, latencies from the trace."""

    request_id: str
    entry: TraceEntry
    ttft: float = float("nan")
    tbt_p90: float = 0.0


@dataclass
class Comparison:
    rate: float
    measured: dict[str, float]
    predicted: dict[str, float]
    # The requests as sent, each with the TTFT and TBT p90 the gateway measured: enough to replay
    # them in a changed simulator without running the deployment again.
    requests: list[TraceEntry] = dataclasses.field(default_factory=list)

    @property
    def errors(self) -> dict[str, float]:
        return {k: (self.predicted[k] - v) / v for k, v in self.measured.items() if v > 0}

    def to_dict(self) -> dict:
        return {
            "rate": self.rate,
            "measured": self.measured,
            "predicted": self.predicted,
            "errors": {k: round(v, 4) for k, v in self.errors.items()},
        }


def image_url(seed: int, size: int = 64) -> str:
    """A distinct random PNG (no two requests share features, so no cache hits to model)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _content(entry: TraceEntry, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = max(1, entry.text_tokens // 2)
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": image_url(seed * 16 + k)}} for k in range(entry.num_images)
    ]
    parts.append({"type": "text", "text": " ".join(rng.choice(_WORDS, words))})
    return parts


async def _one(
    client: openai.AsyncOpenAI, model: str, entry: TraceEntry, seed: int, start: float, tokens_per_image: int
) -> Measured:
    await asyncio.sleep(max(0.0, start + entry.arrival - time.monotonic()))
    sent = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": _content(entry, seed)}],
        max_tokens=max(1, entry.output_tokens),
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    rid, usage = "", None
    async for chunk in stream:
        rid = rid or chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
    sized = TraceEntry(
        arrival=sent - start,
        prompt_tokens=usage.prompt_tokens,
        num_images=entry.num_images,
        image_tokens=entry.num_images * tokens_per_image,
        output_tokens=usage.completion_tokens,
    )
    return Measured(rid, sized)


def attach(measured: Sequence[Measured], records: Sequence) -> None:
    """Fill each request's gateway-measured TTFT and TBT p90 from its trace record."""
    by_id = {r.request_id: r for r in records}
    for m in measured:
        record = by_id.get(m.request_id)
        if record is None or getattr(record, "ttft", None) is None:
            raise RuntimeError(f"no measured trace record for {m.request_id}")
        m.ttft, m.tbt_p90 = record.ttft, record.tbt_p90 or 0.0


async def send(
    url: str,
    model: str,
    entries: Sequence[TraceEntry],
    tokens_per_image: int,
    seed: int = 0,
    one_at_a_time: bool = False,
) -> list[Measured]:
    """Send `entries` at their arrival times (open loop) and measure each at the client; with
    `one_at_a_time`, each request only after the previous one finished (nothing overlaps)."""
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        start = time.monotonic() + 0.1
        if one_at_a_time:
            done = []
            for i, e in enumerate(entries):
                now = dataclasses.replace(e, arrival=max(0.0, time.monotonic() - start))
                done.append(await _one(client, model, now, seed * 100_000 + i, start, tokens_per_image))
            return done
        jobs = [
            _one(client, model, e, seed * 100_000 + i, start, tokens_per_image) for i, e in enumerate(entries)
        ]
        return list(await asyncio.gather(*jobs))


def summarise(ttft: Sequence[float], tbt_p90: Sequence[float]) -> dict[str, float]:
    ttft = np.asarray([t for t in ttft if np.isfinite(t)])
    tbt = [t for t in tbt_p90 if t > 0]
    return {
        "ttft_p50": round(float(np.percentile(ttft, 50)), 5),
        "ttft_p90": round(float(np.percentile(ttft, 90)), 5),
        "tbt_p90": round(float(np.median(tbt)), 5) if tbt else 0.0,
    }


async def cluster_inputs(redis_url: str, namespace: str = "trident") -> tuple[list, list]:
    """The published profiles and every trace record so far."""
    store = await Store.connect(StoreConfig(url=redis_url, prefix=namespace))
    try:
        profiles = await store.planning.profiles()
        records, after = [], "-"
        while True:
            batch = await store.requests.trace(after=after, count=1000)
            if not batch:
                break
            after = batch[-1][0]
            records += [r for _, r in batch]
        return profiles, records
    finally:
        await store.close()


def predict(
    measured: Sequence[Measured], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> dict[str, float]:
    result = simulate([m.entry for m in measured], deployment, profiles, slo)
    return summarise(list(result.ttft), list(result.tbt_p90))


def compare(
    rate: float, measured: Sequence[Measured], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    observed = summarise([m.ttft for m in measured], [m.tbt_p90 for m in measured])
    sent = [dataclasses.replace(m.entry, ttft=m.ttft, tbt_p90=m.tbt_p90 or None) for m in measured]
    return Comparison(rate, observed, predict(measured, deployment, profiles, slo), sent)


def replay(
    rate: float, requests: Sequence[TraceEntry], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    """A saved comparison predicted again (a changed simulator or calibration, the same measurement)."""
    measured = [Measured(e.request_id, e, e.ttft, e.tbt_p90 or 0.0) for e in requests]
    return compare(rate, measured, deployment, profiles, slo)


def calibrated_profiles(
    profile_records: list, trace_records: list, quiet: Sequence[Measured], deployment: Deployment, slo: SLO
) -> tuple[ProfileSet, dict]:
    """Curves from the instances' published profiles, scaled by how the deployed stages compared
    with them, with the spread of their step times; hops and pulls from the same unloaded requests'
    marks (medians), the gateway's dispatch from what their TTFT has beyond a replay; instances
    share this machine's cores. Returns the profiles and what the calibration found."""
    base = ProfileSet.from_records(profile_records)
    factors = stage_factors(trace_records, base.curves)
    transfer = transfer_model(trace_records, base.transfer, quantile=50)
    spread = jitter(trace_records)
    profiles = dataclasses.replace(
        scale_profiles(base, factors, transfer, spread), host_cores=os.cpu_count() or 1
    )
    entries = [dataclasses.replace(m.entry, ttft=m.ttft, tbt_p90=m.tbt_p90 or None) for m in quiet]
    profiles = dataclasses.replace(profiles, transfer=fit_dispatch(entries, deployment, profiles, slo))
    profiles, decode_fit = fit_decode(entries, deployment, profiles, slo)
    found = {
        "stage_factors": factors,
        "decode_fit": decode_fit,
        "transfer": dataclasses.asdict(profiles.transfer),
        "jitter": spread,
        "host_cores": profiles.host_cores,
        "profiles": profiles.to_dict(),  # to replay offline
    }
    return profiles, found


DEPLOYMENTS = {
    "e+p+d": Deployment.of("e+p+d", e=1, p=1, d=1),
    "ep+d": Deployment.of("ep+d", ep=1, d=1),
    "ed+p": Deployment.of("ed+p", ed=1, p=1),
    "epd": Deployment.of("epd", epd=1),
}


def _traced(redis_url: str, measured: list[Measured], timeout: float = 10.0) -> None:
    """Wait until every request's trace record (with the gateway's latencies) is in Redis."""
    deadline = time.monotonic() + timeout
    while True:
        _, records = asyncio.run(cluster_inputs(redis_url))
        try:
            attach(measured, records)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def validate(
    model_dir: Path,
    method: str,
    rates: Sequence[float],
    requests: int,
    workdir: Path,
    slo: SLO,
    *,
    shape: str = "mix",
    max_output: int = 16,
    calibration: int = 16,
    seed: int = 0,
) -> tuple[dict, list[Comparison]]:
    """Measure `method` at each rate (requests/s) and compare with the simulator's prediction
    (module docstring)."""
    from tests.services.cluster import running_cluster

    tokens_per_image = load_config(model_dir).image_seq_length
    env = {"TRIDENT_TTFT_SLO": str(slo.ttft), "TRIDENT_TBT_SLO": str(slo.tbt)}
    with running_cluster(model_dir, workdir, method, env=env) as cluster:
        model = model_dir.name
        # Requests one at a time (none overlaps another): they warm every process up and calibrate
        # the stages against their profiles, the spread of step times and the fixed costs.
        quiet = generate(
            shape,
            rate=2.0,
            num_requests=calibration,
            seed=seed + 1000,
            image_tokens=tokens_per_image,
            max_output_tokens=max_output,
        )
        unloaded = asyncio.run(
            send(cluster.url, model, quiet, tokens_per_image, seed=999, one_at_a_time=True)
        )
        _traced(cluster.redis.url, unloaded)
        profile_records, records = asyncio.run(cluster_inputs(cluster.redis.url))
        deployment = DEPLOYMENTS[method]
        profiles, calibration = calibrated_profiles(profile_records, records, unloaded, deployment, slo)
        results = []
        for i, rate in enumerate(rates):
            entries = generate(
                shape,
                rate=rate,
                num_requests=requests,
                seed=seed + i,
                image_tokens=tokens_per_image,
                max_output_tokens=max_output,
            )
            measured = asyncio.run(send(cluster.url, model, entries, tokens_per_image, seed=i + 1))
            _traced(cluster.redis.url, measured)
            results.append(compare(rate, measured, deployment, profiles, slo))
    return calibration, results
