"""Checking the simulator against the real thing: run a deployment, send it a workload at a rate
(as many times over as asked), take each request's TTFT and TBT p90 as the gateway measured them
(the trace), then replay the same requests (same arrival times, prompt and output lengths) in the
simulator, calibrated as the planner service calibrates itself: the profiles the instances
published, fitted to the steps they ran in service (a calibration load first) — plus the fixed
costs from unloaded requests' stage marks.

The gateway's numbers are per token; the client's are per non-empty text chunk, and a random-weight
model often emits part of a UTF-8 character, which merges two tokens into one chunk.

Compared: TTFT p50 and p90 over requests, the median over requests of each one's TBT p90 (the
quantity the TBT SLO judges), and the share of requests within both SLOs, from which `goodput`
reads the highest rate served. Used by bench/planner_validation.py and tests/planner/test_validation.py.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from common.engine.loader import load_config
from common.planner.calibrate import calibrate_from_service, fit_dispatch, transfer_model
from common.planner.host_cpu import HostCpu, measure_host_cpu
from common.planner.profiles import ProfileSet, TransferModel, scale_profiles
from common.planner.simulator import simulate
from common.planner.trace import (
    TraceEntry,
    entry_from_json,
    entry_json,
    from_records,
    read_trace,
    write_trace,
)
from common.planner.types import Deployment
from common.planner.workloads import generate
from common.protocol import StepStats
from common.stats import SLO, slo_met
from common.store import Store, StoreConfig
from common.threads import thread_split
from services.settings import WorkerSettings
from trident.bench.repeat import Repeats, conversation_rate
from trident.launcher.processes import Starter

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


METRICS = ("ttft_p50", "ttft_p90", "tbt_p90")  # latencies compared, each a median over repeats


@dataclass
class Comparison:
    """One rate: each repeat's measurement (the same requests sent again), their median and spread,
    and the simulator's prediction for the same requests (the median over the repeats' replays,
    which differ only in the arrival times as actually sent)."""

    rate: float
    measured: dict[str, float]  # median over repeats: METRICS and attainment
    predicted: dict[str, float]
    spread: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # [min, max] over repeats
    repeats: list[dict[str, float]] = dataclasses.field(default_factory=list)  # each repeat's measurement
    # Each repeat's requests as sent, with the TTFT and TBT p90 the gateway measured: enough to replay
    # them in a changed simulator without running the deployment again.
    runs: list[list[TraceEntry]] = dataclasses.field(default_factory=list)
    # Each repeat's requests' stage marks (common/store/requests.py `Stage`), in the order of `runs`:
    # where a request's time went, to tell which stage a prediction misses.
    marks: list[list[dict[str, float]]] = dataclasses.field(default_factory=list)

    @property
    def errors(self) -> dict[str, float]:
        return {
            k: (self.predicted[k] - self.measured[k]) / self.measured[k]
            for k in METRICS
            if self.measured[k] > 0
        }

    def to_dict(self) -> dict:
        return {
            "rate": self.rate,
            "measured": self.measured,
            "spread": self.spread,
            "predicted": self.predicted,
            "errors": {k: round(v, 4) for k, v in self.errors.items()},
            "repeats": self.repeats,
        }


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float) -> float:
    """The highest rate whose attainment reaches `target`, read between the swept rates: past the
    last rate that reaches it, linearly toward the first that does not (0 if none does; the top
    rate if all do). Measured and predicted goodput are read the same way."""
    points = sorted(zip(rates, attainments, strict=True))
    best = 0.0
    for (rate, att), after in zip(points, [*points[1:], None], strict=True):
        if att < target:
            break
        best = rate
        if after is not None and after[1] < target:
            next_rate, next_att = after
            best = rate + (next_rate - rate) * (att - target) / (att - next_att)
            break
    return round(best, 4)


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
        if getattr(record, "ttft", None) is None:
            raise RuntimeError(
                f"the trace record of {m.request_id} has no gateway-measured TTFT "
                f"(finish reason {record.finish_reason!r}, stages {sorted(record.stages)})"
            )
        m.ttft, m.tbt_p90 = record.ttft, record.tbt_p90 or 0.0
        start = record.stages.get("arrival", record.arrival)
        m.stages = {k: round(v - start, 6) for k, v in record.stages.items()}
    if any(m.entry is None for m in measured):
        sized = {e.request_id: e for e in from_records(by_id[m.request_id] for m in measured)}
        for m in measured:
            m.entry = dataclasses.replace(sized[m.request_id], ttft=None, tbt_p90=None, slo_met=None)


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


async def send_turns(
    url: str, model: str, entries: Sequence[TraceEntry], repeats: Repeats, seed: int
) -> list[Measured]:
    """`entries` as the first turns of conversations (trident/bench/client.py: each later turn
    resends the history a think time after the answer before it), every turn a request. Each is
    sized from its trace record (`attach`): what the server cached and computed is the record's."""
    from trident.bench import client

    opts = client.RequestOptions(model=model, image_size=(64, 64), seed=seed, repeats=repeats)
    results = await client.run(url, entries, opts)
    if failed := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} of {len(results)} turns failed, the first: {failed[0]}")
    return [Measured(r.request_id, None) for r in results]


def summarise(entries: Sequence[TraceEntry], slo: SLO) -> dict[str, float]:
    """TTFT p50/p90 over requests, the median of their TBT p90s, and the share that met both SLOs."""
    ttft = np.asarray([e.ttft for e in entries if e.ttft is not None and np.isfinite(e.ttft)])
    tbt = [e.tbt_p90 for e in entries if e.tbt_p90]
    met = [slo_met(e.ttft, e.tbt_p90 or None, slo) for e in entries]
    return {
        "ttft_p50": round(float(np.percentile(ttft, 50)), 5) if len(ttft) else float("nan"),
        "ttft_p90": round(float(np.percentile(ttft, 90)), 5) if len(ttft) else float("nan"),
        "tbt_p90": round(float(np.median(tbt)), 5) if tbt else 0.0,
        "attainment": round(float(np.mean(met)), 4) if met else 1.0,
    }


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


PREDICTION_SEEDS = 5  # simulations of each repeat, each with its own draws of the steps' jitter


def predict(entries: Sequence[TraceEntry], deployment: Deployment, profiles: ProfileSet, slo: SLO) -> dict:
    """The simulator's figures for `entries`: the median over PREDICTION_SEEDS simulations. One
    draw of the jitter is as noisy as one measured run: a p90 over 30 requests is their third
    slowest, and one slow step moves it."""
    rows = []
    for seed in range(PREDICTION_SEEDS):
        result = simulate(entries, deployment, profiles, slo, seed=seed)
        replayed = [
            dataclasses.replace(e, ttft=float(t), tbt_p90=float(g) or None)
            for e, t, g in zip(entries, result.ttft, result.tbt_p90, strict=True)
        ]
        rows.append(summarise(replayed, slo))
    return _median(rows)


def _median(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: round(float(np.median([r[k] for r in rows])), 5) for k in rows[0]}


def compare(
    rate: float, runs: Sequence[Sequence[TraceEntry]], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    """Each repeat's measured requests summarised and replayed; medians, spreads and the repeats."""
    observed = [summarise(run, slo) for run in runs]
    predicted = [predict(run, deployment, profiles, slo) for run in runs]
    spread = {k: [min(r[k] for r in observed), max(r[k] for r in observed)] for k in observed[0]}
    return Comparison(rate, _median(observed), _median(predicted), spread, observed, [list(r) for r in runs])


def replay(
    rate: float, runs: Sequence[Sequence[TraceEntry]], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    """A saved comparison predicted again (a changed simulator or calibration, the same measurement)."""
    return compare(rate, runs, deployment, profiles, slo)


@dataclass(frozen=True)
class Measurements:
    """What a calibration is found from: the instances' profiles as published (`base`), their steps
    in service, the fixed costs from the unloaded requests' stage marks (hops and pulls, medians),
    the requests sent one at a time (`quiet`) and under the calibration load (`loaded`), and what
    that load cost outside the instances (`host_cpu`; None: not charged)."""

    base: ProfileSet
    step_records: Sequence[StepStats]
    transfer: TransferModel
    quiet: Sequence[TraceEntry]
    loaded: Sequence[TraceEntry]
    host_cpu: HostCpu | None = None

    def to_dict(self) -> dict:
        """Kept with a run, to calibrate it again offline (`recalibrate`)."""
        return {
            "base_profiles": self.base.to_dict(),
            "marks_transfer": dataclasses.asdict(self.transfer),
            "step_stats": [st.model_dump(mode="json") for st in self.step_records],
            "quiet": [entry_json(e) for e in self.quiet],
            "loaded": [entry_json(e) for e in self.loaded],
            "host_cpu": self.host_cpu.to_dict() if self.host_cpu else None,
        }

    @classmethod
    def from_dict(cls, kept: dict) -> Measurements:
        return cls(
            ProfileSet.from_dict(kept["base_profiles"]),
            [StepStats(**s) for s in kept["step_stats"]],
            TransferModel(**kept["marks_transfer"]),
            [entry_from_json(e) for e in kept["quiet"]],
            [entry_from_json(e) for e in kept["loaded"]],
            HostCpu(**kept["host_cpu"]) if kept.get("host_cpu") else None,  # runs before: none
        )


def calibrate(
    measured: Measurements, deployment: Deployment, slo: SLO, host_cores: int | None = None
) -> tuple[ProfileSet, dict]:
    """What the planner service does, plus the fixed costs its stage curves cannot see: the curves
    fitted to the steps the instances ran in service and the spread of steps of one shape
    (`service_factors`, as the planner's TRIDENT_PLANNER_CALIBRATE); the time between two steps
    that holds no core, from the gaps between tokens the client saw under the calibration load
    (`fit_step_gap` on `loaded`, as the planner fits it on its window); then the gateway's
    dispatch, from what the unloaded requests' TTFT has beyond a replay with all of that
    (`fit_dispatch` on `quiet`); the instances share `host_cores` (default: this machine's), less
    what requests cost outside them (`host_cpu`, as the planner measures it)."""
    base = dataclasses.replace(
        measured.base, transfer=measured.transfer, host_cores=host_cores or os.cpu_count() or 1
    )
    service = calibrate_from_service(
        measured.step_records, base, measured.loaded, deployment, slo, measured.host_cpu
    )
    profiles = service.apply(base)
    profiles = dataclasses.replace(profiles, transfer=fit_dispatch(measured.quiet, deployment, profiles, slo))
    found = {
        "service": service.to_dict(),
        "transfer": dataclasses.asdict(profiles.transfer),
        "host_cores": profiles.host_cores,
        "slo": dataclasses.asdict(slo),
        "profiles": profiles.to_dict(),  # to replay offline
    }
    return profiles, found


def recalibrate(calibration: dict, method: str) -> tuple[ProfileSet, dict]:
    """`calibrate` again on what a recorded run kept (`Measurements.to_dict`): the calibration as
    the code now does it, on the same data."""
    slo = SLO(**calibration["slo"])
    # The recorded machine's cores.
    return calibrate(Measurements.from_dict(calibration), DEPLOYMENTS[method], slo, calibration["host_cores"])


GOAL = 0.20  # the bound on every prediction error
Run = tuple[str, str, dict, list[Comparison]]  # preset, method, calibration, one comparison per rate

DEPLOYMENTS = {
    "e+p+d": Deployment.of("e+p+d", e=1, p=1, d=1),
    "ep+d": Deployment.of("ep+d", ep=1, d=1),
    "ed+p": Deployment.of("ed+p", ed=1, p=1),
    "epd": Deployment.of("epd", epd=1),
}


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
        target = _Live(cluster.url, cluster.redis.url, model_dir.name, tokens_per_image)
        profiles, found = _calibrate(target, run, deployment)
        measured = _measure(target, run)
    comparisons = []
    for rate, runs in measured.items():
        comparison = compare(rate, [measured_entries(r) for r in runs], deployment, profiles, run.slo)
        comparison.marks = [[m.stages for m in r] for r in runs]
        comparisons.append(comparison)
    return found, comparisons


@dataclass(frozen=True)
class _Live:
    """The deployment under measurement: its gateway, its Redis, the model it serves."""

    url: str
    redis_url: str
    model: str
    tokens_per_image: int


def _calibrate(live: _Live, run: Validation, deployment: Deployment) -> tuple[ProfileSet, dict]:
    """The calibration's requests sent, and the profiles calibrated on what they left."""
    from trident.launcher.cluster import method_workers

    workers = len(method_workers(run.method))
    # Requests one at a time (none overlaps another): the fixed costs and the client's TBT.
    quiet = run.workload(2.0, run.calibration, run.seed + 1000, live.tokens_per_image)
    unloaded = asyncio.run(
        send(live.url, live.model, quiet, live.tokens_per_image, seed=999, one_at_a_time=True)
    )
    _traced(live.redis_url, unloaded)
    # Then a load, so that the steps the instances publish are steps in service; the workers'
    # CPU counters before it and after it give what the load cost outside them.
    before = _published_since(live.redis_url, time.time(), workers)
    middle = run.calibration_rate or sorted(run.rates)[len(run.rates) // 2]
    load = run.workload(middle, run.calibration_load or run.requests, run.seed + 2000, live.tokens_per_image)
    loaded = asyncio.run(send(live.url, live.model, load, live.tokens_per_image, seed=998))
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


def _measure(live: _Live, run: Validation) -> dict[float, list[list[Measured]]]:
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
                sending = send(live.url, live.model, entries, live.tokens_per_image, seed=next(contents))
            else:
                count = max(1, run.requests // run.turns.turns)
                talks = run.workload(
                    conversation_rate(rate, run.turns), count, run.seed, live.tokens_per_image
                )
                sending = send_turns(live.url, live.model, talks, run.turns, seed=next(contents))
            sent = asyncio.run(sending)
            _traced(live.redis_url, sent)
            measured[rate].append(sent)
    return measured


def summary(runs: list[Run], slo: SLO) -> dict:
    """Every comparison, each system's goodput, the pick, the largest errors and the goals.

    The latency goals are judged at the rates a deployment is run at: those whose measured median
    attainment meets the SLOs (`in_range`). Past its goodput a deployment's queue grows for as long
    as requests keep coming, so its TTFT there says how long the run lasted more than how good the
    model is; those errors are reported too (`max_abs_error_all_rates`)."""
    report: dict = {"calibration": [], "runs": [], "goodput": {}}
    errors: dict[str, list[float]] = {"ttft_p90": [], "tbt_p90": [], "goodput": []}
    everywhere: dict[str, list[float]] = {"ttft_p90": [], "tbt_p90": []}
    measured_by_repeat: dict[str, list[float]] = {}
    step = 0.0
    for preset, method, calibration, comparisons in runs:
        name = f"{preset} {method}"
        kept = ("profiles", "base_profiles", "marks_transfer", "step_stats", "quiet", "loaded")  # data
        brief = {k: v for k, v in calibration.items() if k not in kept}
        report["calibration"].append({"preset": preset, "method": method, **brief})
        rates = [c.rate for c in comparisons]
        step = max(step, min((b - a for a, b in itertools.pairwise(rates)), default=0.0))
        for c in comparisons:
            in_range = c.measured["attainment"] >= slo.attainment
            report["runs"].append({"preset": preset, "method": method, **c.to_dict(), "in_range": in_range})
            for metric in everywhere:
                everywhere[metric].append(c.errors.get(metric, 0.0))
                if in_range:
                    errors[metric].append(c.errors.get(metric, 0.0))
        per_repeat, error, row = _goodputs(rates, comparisons, slo)
        measured_by_repeat[name] = per_repeat
        errors["goodput"].append(error)
        report["goodput"][name] = row
    report["pick"] = _pick(report["goodput"], measured_by_repeat, step)
    picked, within = report["pick"], report["pick"]["within_one_step"]
    worst = {k: round(max((abs(e) for e in v), default=0.0), 4) for k, v in errors.items()}
    report["max_abs_error"] = worst
    report["max_abs_error_all_rates"] = {k: round(max(abs(e) for e in v), 4) for k, v in everywhere.items()}
    report["goals_met"] = {
        "ttft_p90_within_20pct": worst["ttft_p90"] <= GOAL,
        "tbt_p90_within_20pct": worst["tbt_p90"] <= GOAL,
        "goodput_within_20pct": worst["goodput"] <= GOAL,
        "pick_goodput_within_20pct": abs(picked["error"]) <= GOAL,
        "pick_within_one_step_every_repeat": all(within),
    }
    return report


def _goodputs(rates: list[float], comparisons: list[Comparison], slo: SLO) -> tuple[list[float], float, dict]:
    """A system's goodput measured in each repeat and predicted; the prediction's error against the
    measured median; the report's row."""
    repeats = len(comparisons[0].repeats)
    per_repeat = [
        goodput(rates, [c.repeats[k]["attainment"] for c in comparisons], slo.attainment)
        for k in range(repeats)
    ]
    median = sorted(per_repeat)[len(per_repeat) // 2]
    predicted = goodput(rates, [c.predicted["attainment"] for c in comparisons], slo.attainment)
    error = (predicted - median) / median if median else (0.0 if predicted == 0 else float("inf"))
    row = {
        "measured": per_repeat,
        "measured_median": median,
        "predicted": predicted,
        "error": round(error, 4),
    }
    return per_repeat, error, row


def _pick(goodputs: dict[str, dict], measured_by_repeat: dict[str, list[float]], step: float) -> dict:
    """The system with the highest predicted goodput, and in each repeat whether its measured
    goodput was within one rate step of the best measured."""
    chosen = max(goodputs, key=lambda n: goodputs[n]["predicted"])
    picked = goodputs[chosen]
    repeats = len(measured_by_repeat[chosen])
    best = [max(measured_by_repeat, key=lambda n: measured_by_repeat[n][k]) for k in range(repeats)]
    within = [
        measured_by_repeat[chosen][k] >= measured_by_repeat[best[k]][k] - step - 1e-9 for k in range(repeats)
    ]
    return {
        "system": chosen,
        "predicted": picked["predicted"],
        "measured_median": picked["measured_median"],
        "error": picked["error"],
        "best_by_repeat": best,
        "within_one_step": within,
        "step": step,
    }


def save(folder: Path, preset: str, method: str, calibration: dict, comparisons: list[Comparison]) -> None:
    """calibration.json, and per rate and repeat the requests with their measurements (a trace
    whose header carries the calibrated profiles, so `trident plan --trace` plans it with them) and
    their stage marks, line by line in the trace's order."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calibration.json").write_text(json.dumps({"preset": preset, "method": method, **calibration}))
    for c in comparisons:
        for k, run in enumerate(c.runs):
            meta = {"rate": c.rate, "repeat": k, "profiles": calibration["profiles"]}
            write_trace(folder / f"rate-{c.rate:g}-repeat-{k}.jsonl", run, meta=meta)
        for k, marks in enumerate(c.marks):
            lines = "".join(json.dumps(m, sort_keys=True) + "\n" for m in marks)
            (folder / f"marks-rate-{c.rate:g}-repeat-{k}.jsonl").write_text(lines)


def replay_folder(
    folder: Path, slo: SLO | None = None, *, recalibrated: bool = False, slower: float = 1.0
) -> Run:
    """What `save` kept, predicted again by today's simulator at the SLOs it was measured with (or
    `slo`): with the calibration then found, or `recalibrated` from the data it was found from;
    every stage's steps `slower` times as long (how much a calibration's error moves a figure)."""
    calibration = json.loads((folder / "calibration.json").read_text())
    preset, method = calibration.pop("preset"), calibration.pop("method")
    slo = slo or SLO(**calibration["slo"])
    if recalibrated:
        profiles, found = recalibrate(calibration, method)
        calibration = {**calibration, **found}
    else:
        profiles = ProfileSet.from_dict(calibration["profiles"])
    if slower != 1.0:
        profiles = scale_profiles(profiles, dict.fromkeys(("encode", "prefill", "decode"), slower))
    by_rate: dict[float, list] = {}
    for path in sorted(folder.glob("rate-*-repeat-*.jsonl")):
        trace = read_trace(path)
        by_rate.setdefault(float(trace.meta["rate"]), []).append((int(trace.meta["repeat"]), trace.entries))
    comparisons = [
        replay(rate, [entries for _, entries in sorted(runs)], DEPLOYMENTS[method], profiles, slo)
        for rate, runs in sorted(by_rate.items())
    ]
    return preset, method, calibration, comparisons
