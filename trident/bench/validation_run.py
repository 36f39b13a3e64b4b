"""A validation's run against a live deployment (trident/bench/validation.py compares what it
measures with the simulator's prediction): the deployment started, a calibration load and then the
workload at each rate sent, and each request's TTFT and TBT p90 read back as the gateway measured
them (its trace record), with what the instances published (profiles, steps in service)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from common.engine.loader import load_config
from common.planner.calibrate import transfer_model
from common.planner.host_cpu import measure_host_cpu
from common.planner.profiles import ProfileSet
from common.planner.trace import TraceEntry, from_records
from common.planner.types import Deployment
from common.planner.workloads import generate
from common.stats import SLO
from common.store import Store, StoreConfig
from common.store.requests import Stage
from common.threads import thread_split
from services.settings import WorkerSettings
from trident.bench.repeat import Repeats, conversation_rate
from trident.bench.validation import DEPLOYMENTS, Comparison, Measurements, calibrate, compare
from trident.launcher.processes import Starter


@dataclass(frozen=True)
class Live:
    """The deployment under measurement: its gateway, its Redis, the model it serves and the tokens
    it gives an image."""

    url: str
    redis_url: str
    model: str
    tokens_per_image: int


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
    entry: TraceEntry | None  # None until its trace record sizes it (a turn of a conversation)
    ttft: float = float("nan")
    tbt_p90: float = 0.0
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # s after its arrival mark


def image_url(seed: int, size: int = 64) -> str:
    """A random PNG, distinct for each seed: requests of distinct seeds share no features, so no
    cache hits to model."""
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
    client: openai.AsyncOpenAI, live: Live, entry: TraceEntry, seed: int, start: float
) -> Measured:
    await asyncio.sleep(max(0.0, start + entry.arrival - time.monotonic()))
    sent = time.monotonic()
    stream = await client.chat.completions.create(
        model=live.model,
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
        image_tokens=entry.num_images * live.tokens_per_image,
        output_tokens=usage.completion_tokens,
    )
    return Measured(rid, sized)


def measured_entries(measured: Sequence[Measured]) -> list[TraceEntry]:
    """Each request as sent, with the TTFT and TBT p90 the gateway measured for it."""
    return [dataclasses.replace(m.entry, ttft=m.ttft, tbt_p90=m.tbt_p90 or None) for m in measured]


def attach(measured: Sequence[Measured], records: Sequence) -> None:
    """Fill each request's gateway-measured TTFT and TBT p90 from its trace record; a request not
    sized yet takes its sizes, cached tokens and stored images from the record too, its arrival
    relative to the earliest of `measured`."""
    by_id = {r.request_id: r for r in records}
    for m in measured:
        record = by_id.get(m.request_id)
        if record is None:
            raise RuntimeError(f"no trace record for {m.request_id}")
        if getattr(record, "ttft", None) is None or Stage.FIRST_TOKEN not in record.stages:
            # The calibration reads the first-token mark too. An entry lacks it only when a
            # recorder's grace fallback appended it without prefill's mark (common/store/requests.py).
            raise RuntimeError(
                f"the trace record of {m.request_id} has no gateway-measured TTFT or first-token mark "
                f"yet (finish reason {record.finish_reason!r}, stages {sorted(record.stages)})"
            )
        m.ttft, m.tbt_p90 = record.ttft, record.tbt_p90 or 0.0
        start = record.stages.get("arrival", record.arrival)
        m.stages = {k: round(v - start, 6) for k, v in record.stages.items()}
    if any(m.entry is None for m in measured):
        sized = {e.request_id: e for e in from_records(by_id[m.request_id] for m in measured)}
        for m in measured:
            m.entry = dataclasses.replace(sized[m.request_id], ttft=None, tbt_p90=None, slo_met=None)


async def send(
    live: Live, entries: Sequence[TraceEntry], seed: int = 0, one_at_a_time: bool = False
) -> list[Measured]:
    """Send `entries` at their arrival times (open loop) and measure each at the client; with
    `one_at_a_time`, each request only after the previous one finished (nothing overlaps)."""
    async with openai.AsyncOpenAI(
        base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        start = time.monotonic() + 0.1
        if one_at_a_time:
            done = []
            for i, e in enumerate(entries):
                now = dataclasses.replace(e, arrival=max(0.0, time.monotonic() - start))
                done.append(await _one(client, live, now, seed * 100_000 + i, start))
            return done
        jobs = [_one(client, live, e, seed * 100_000 + i, start) for i, e in enumerate(entries)]
        return list(await asyncio.gather(*jobs))


async def send_turns(
    live: Live, entries: Sequence[TraceEntry], repeats: Repeats, seed: int
) -> list[Measured]:
    """`entries` as the first turns of conversations (trident/bench/client.py: each later turn
    resends the history a think time after the answer before it), every turn a request. Each is
    sized from its trace record (`attach`): what the server cached and computed is the record's."""
    from trident.bench import client

    opts = client.RequestOptions(model=live.model, image_size=(64, 64), seed=seed, repeats=repeats)
    results = await client.run(live.url, entries, opts)
    if failed := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} of {len(results)} turns failed, the first: {failed[0]}")
    return [Measured(r.request_id, None) for r in results]


async def published_steps(redis_url: str, namespace: str = "trident") -> list:
    """Each instance's latest StepStats (and nothing else: the bench's own CPU is on the cores
    the calibration measures)."""
    store = await Store.connect(StoreConfig(url=redis_url, prefix=namespace))
    try:
        return await store.planning.steps()
    finally:
        await store.close()


async def cluster_inputs(redis_url: str, namespace: str = "trident") -> tuple[list, list, list]:
    """The published profiles, every trace record so far, and each instance's latest StepStats."""
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
        return profiles, records, await store.planning.steps()
    finally:
        await store.close()


def _traced(redis_url: str, measured: list[Measured], timeout: float = 60.0) -> None:
    """Wait until every request's trace record (with the gateway's latencies) is in Redis."""
    deadline = time.monotonic() + timeout
    while True:
        _, records, _ = asyncio.run(cluster_inputs(redis_url))
        try:
            attach(measured, records)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _published_since(redis_url: str, since: float, instances: int, timeout: float = 30.0) -> list:
    """Each instance's StepStats, once all `instances` have published one after wall time `since`
    (every 5 s after they step, every 15 s when idle)."""
    deadline = time.monotonic() + timeout
    while True:
        steps = asyncio.run(published_steps(redis_url))
        if len([s for s in steps if s.time > since]) >= instances:
            return steps
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(steps)} of {instances} instances published their steps within {timeout:.0f} s"
            )
        time.sleep(0.5)


@dataclass(frozen=True)
class Validation:
    """One method measured at each rate (requests/s), `repeats` times over, against the simulator's
    prediction (module docstring). Before measuring, `calibration` requests one at a time and then
    `calibration_load` more (default: `requests`) at `calibration_rate` (default: the middle rate),
    with seeds of their own, warm the deployment up and give the calibration its steps in service.
    With `turns`, the measured requests are turns of conversations that repeat (a shared system
    prompt, history resent each turn: trident/bench/repeat.py), `requests` turns per rate and
    repeat, and the simulator finds cached what each turn's trace record says the server found."""

    method: str
    rates: Sequence[float]
    requests: int
    slo: SLO
    repeats: int = 1
    shape: str = "mix"
    max_output: int = 16
    calibration: int = 16
    calibration_rate: float | None = None
    calibration_load: int | None = None
    seed: int = 0
    turns: Repeats | None = None

    def workload(self, rate: float, count: int, seed: int, tokens_per_image: int) -> list[TraceEntry]:
        return generate(
            self.shape,
            rate=rate,
            num_requests=count,
            seed=seed,
            image_tokens=tokens_per_image,
            max_output_tokens=self.max_output,
        )

    def env(self, workdir: Path) -> dict[str, str]:
        """The deployment's environment: as deployed, but for what a measurement needs fixed."""
        from trident.launcher.cluster import method_workers

        cpus = len(os.sched_getaffinity(0))
        return {
            "TRIDENT_TTFT_SLO": str(self.slo.ttft),
            "TRIDENT_TBT_SLO": str(self.slo.tbt),
            # Profiled as deployed (the test clusters profile each point once, to start fast; a curve
            # timed once on cores the other workers are profiling on is too noisy to fit to).
            "TRIDENT_PROFILE_REPEATS": str(WorkerSettings.model_fields["profile_repeats"].default),
            # Threads as `trident up` gives them: a share of the cores each, and a core board from
            # which the workers that encode or prefill take the cores the others leave idle.
            "TRIDENT_NUM_THREADS": str(thread_split(cpus, len(method_workers(self.method)))),
            "TRIDENT_CORE_BOARD": str(workdir / "cores"),
            # The client lets an idle connection go after 5 s (httpx's default); a gateway that closed
            # it at 5 s too would meet a request sent on it meanwhile, which fails unretried.
            "TRIDENT_KEEP_ALIVE_TIMEOUT": "30",
            "TRIDENT_HOST_CORES": str(cpus),
            # The KV space the recorded runs (tests/data) had; conversations, whose prompts grow turn
            # by turn and whose prefixes stay cached, get the deployed default.
            "TRIDENT_KV_CACHE_BYTES": str(
                WorkerSettings.model_fields["kv_cache_bytes"].default if self.turns else 16 << 20
            ),
        }


def validate(
    model_dir: Path, workdir: Path, run: Validation, starter: Starter | None = None
) -> tuple[dict, list[Comparison]]:
    """Measure and compare as `run` says; `starter`: how the deployment's processes start
    (trident/launcher/processes.py). Returns what the calibration found and one comparison per rate."""
    from trident.launcher.cluster import running_cluster

    tokens_per_image = load_config(model_dir).image_seq_length
    deployment = DEPLOYMENTS[run.method]
    with running_cluster(model_dir, workdir, run.method, env=run.env(workdir), starter=starter) as cluster:
        target = Live(cluster.url, cluster.redis.url, model_dir.name, tokens_per_image)
        profiles, found = _calibrate(target, run, deployment)
        measured = _measure(target, run)
    comparisons = []
    for rate, runs in measured.items():
        comparison = compare(rate, [measured_entries(r) for r in runs], deployment, profiles, run.slo)
        comparison.marks = [[m.stages for m in r] for r in runs]
        comparisons.append(comparison)
    return found, comparisons


def _calibrate(live: Live, run: Validation, deployment: Deployment) -> tuple[ProfileSet, dict]:
    """The calibration's requests sent, and the profiles calibrated on what they left."""
    from trident.launcher.cluster import method_workers

    workers = len(method_workers(run.method))
    # Requests one at a time (none overlaps another): the fixed costs and the client's TBT.
    quiet = run.workload(2.0, run.calibration, run.seed + 1000, live.tokens_per_image)
    unloaded = asyncio.run(send(live, quiet, seed=999, one_at_a_time=True))
    _traced(live.redis_url, unloaded)
    # Then a load, so that the steps the instances publish are steps in service; the workers'
    # CPU counters before it and after it give what the load cost outside them.
    before = _published_since(live.redis_url, time.time(), workers)
    middle = run.calibration_rate or sorted(run.rates)[len(run.rates) // 2]
    load = run.workload(middle, run.calibration_load or run.requests, run.seed + 2000, live.tokens_per_image)
    loaded = asyncio.run(send(live, load, seed=998))
    steps = _published_since(live.redis_url, time.time(), workers)
    _traced(live.redis_url, loaded)
    profile_records, records, _ = asyncio.run(cluster_inputs(live.redis_url))
    base = ProfileSet.from_records(profile_records)
    measured = Measurements(
        base,
        steps,
        transfer_model(records, base.transfer, quantile=50),
        measured_entries(unloaded),
        measured_entries(loaded),
        measure_host_cpu(before, steps, records),
    )
    profiles, found = calibrate(measured, deployment, run.slo)
    return profiles, {**found, **measured.to_dict()}


def _measure(live: Live, run: Validation) -> dict[float, list[list[Measured]]]:
    """Every rate, `run.repeats` times over: the requests sent and their trace records attached."""
    measured: dict[float, list[list[Measured]]] = {rate: [] for rate in run.rates}
    # Each run's content from a seed of its own (past the calibration's 998 and 999): an image
    # sent before would be found in the encoder's feature cache and not encoded at all.
    contents = itertools.count(1000)
    for _ in range(run.repeats):
        for rate in run.rates:
            # Requests of the same sizes at every rate and in every repeat, their arrival times
            # scaled (`generate`), so the points of a sweep differ in rate alone.
            if run.turns is None:
                entries = run.workload(rate, run.requests, run.seed, live.tokens_per_image)
                sending = send(live, entries, seed=next(contents))
            else:
                count = max(1, run.requests // run.turns.turns)
                talks = run.workload(
                    conversation_rate(rate, run.turns), count, run.seed, live.tokens_per_image
                )
                sending = send_turns(live, talks, run.turns, seed=next(contents))
            sent = asyncio.run(sending)
            _traced(live.redis_url, sent)
            measured[rate].append(sent)
    return measured
