"""Ten times more requests than the deployment can serve, for minutes: is the overload bounded?

    python bench/overload.py [--factor 10] [--duration 180] [--tokens 64] [--abandon 0.3]
                             [--model DIR] [--workdir .trident/overload]

Runs `trident up` (E+P+D, one of each, the tiny model by default, every limit at its default),
measures what it completes per second under a closed loop of 8 streams, then offers `--factor`
times that rate, open loop (Poisson arrivals: a request goes out at its time whatever happened to
the others), for `--duration` seconds. A share `--abandon` of the clients leave after 0.5-3 s, as
impatient users do; the others wait for the end (the gateway's deadline, TRIDENT_REQUEST_TIMEOUT,
is 60 s here). Every 5 s it samples the resident memory of every process and the gateway's
in-flight and queued-task gauges.

Reported: how requests ended (completed, 429, other errors, abandoned, hung: no end 15 s past the
deadline), the offered and achieved rates (the client sends what it can when it falls behind), the
largest queue, each process's memory over the first and last thirds of the overload, and how long
after the load stopped every worker and the gateway held nothing (abandoned work must not pile
up). Goals: 0 hung; Trident's processes flat (< 10 % growth from the first third to the last;
NATS and Redis keep a history that grows towards its caps, and are shown beside); everything
released within 30 s of the end. Last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from trident.bench.machine import matmul_gflops
from trident.launcher.local_up import LocalUp, UpCommand, metric, model_or_tiny, rss_bytes

DEADLINE = 60.0  # the gateway's request timeout in this run
SAMPLE = 5.0  # seconds between samples
FLAT = 0.10  # most growth of a process's memory, first third of the run to the last
RELEASE_GOAL = 30.0  # seconds after the load for every held request to be gone
ONE = {"encoder": 1, "prefill": 1, "decode": 1}
SERVERS = ("nats", "redis")


def body(tokens: int, i: int) -> dict:
    return {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def one(
    http: httpx.AsyncClient, url: str, payload: dict, leave_after: float | None, tally: Counter
) -> None:
    """One streaming request; what became of it goes to `tally`."""
    try:
        async with asyncio.timeout(leave_after or DEADLINE + 15):
            async with http.stream("POST", url, json=payload) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    tally[f"{resp.status_code} {_code(resp.text)}"] += 1
                    return
                async for line in resp.aiter_lines():
                    if line.startswith('data: {"error"'):
                        tally[f"stream {_code(line[6:])}"] += 1
                        return
                    if line == "data: [DONE]":
                        tally["completed"] += 1
                        return
        tally["cut"] += 1
    except TimeoutError:
        tally["abandoned" if leave_after else "hung"] += 1
    except httpx.HTTPError as exc:
        tally[type(exc).__name__] += 1


def _code(body: str) -> str:
    """An error body's `code` (or `type`), to tell the causes apart."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


async def closed_loop(url: str, tokens: int, streams: int, seconds: float) -> float:
    """Requests completed per second by `streams` clients asking one after another."""
    tally: Counter = Counter()
    end = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.monotonic() < end:
            await one(http, url, body(tokens, k * 1000 + i), None, tally)
            i += 1

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=DEADLINE + 15)) as http:
        await asyncio.gather(*(client(http, k) for k in range(streams)))
    return tally["completed"] / (time.monotonic() - start)


@dataclass(frozen=True)
class Offered:
    """The overload: Poisson arrivals at `rate` for `seconds` of wall time, the share `abandon` of
    clients leaving early."""

    rate: float
    seconds: float
    abandon: float


async def open_loop(url: str, tokens: int, offered: Offered, tally: Counter) -> float:
    """The offered load sent; returns the rate actually sent (less when this client cannot keep up:
    it then sends as fast as it can)."""
    rate, seconds, abandon = offered.rate, offered.seconds, offered.abandon
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    sent, start, due = 0, time.monotonic(), 0.0
    timeout = httpx.Timeout(30.0, read=DEADLINE + 15)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http, asyncio.TaskGroup() as tg:
        while time.monotonic() - start < seconds:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + due - time.monotonic()))
            leave = rng.uniform(0.5, 3.0) if rng.random() < abandon else None
            tg.create_task(one(http, url, body(tokens, sent), leave, tally))
            sent += 1
        achieved = sent / (time.monotonic() - start)
    return achieved


def sample(d: LocalUp, samples: list[dict]) -> None:
    procs = d.processes()
    try:
        in_flight = metric(d.url, "trident_gateway_in_flight")
        queued = metric(d.url, "trident_gateway_queued_tasks")
    except httpx.HTTPError:
        in_flight = queued = float("nan")
    samples.append(
        {
            "t": time.monotonic(),
            "rss": {n: rss_bytes(p) for n, p in procs.items()},
            "in_flight": in_flight,
            "queued": queued,
        }
    )


async def sampler(d: LocalUp, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.to_thread(sample, d, samples)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE)


def held_anywhere(d: LocalUp) -> float:
    workers = d.cluster()
    held = sum(metric(w["http_address"], "trident_held_requests") for w in workers)
    return held + metric(d.url, "trident_gateway_in_flight")


def release_time(d: LocalUp, timeout: float = 120.0) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if held_anywhere(d) == 0:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None


def memory(samples: list[dict]) -> dict[str, dict]:
    """Each process's mean resident memory over the first and the last third of the samples."""
    third = max(1, len(samples) // 3)
    first, last = samples[:third], samples[-third:]
    found = {}
    for name in samples[0]["rss"]:
        a = statistics.mean(s["rss"].get(name, 0) for s in first) / 2**20
        b = statistics.mean(s["rss"].get(name, 0) for s in last) / 2**20
        found[name] = {
            "first_mib": round(a, 1),
            "last_mib": round(b, 1),
            "growth": round((b - a) / a, 3) if a else 0.0,
        }
    return found


async def run(d: LocalUp, args: argparse.Namespace) -> dict:
    url = d.url + "/v1/chat/completions"
    gflops = matmul_gflops()
    capacity = await closed_loop(url, args.tokens, 8, 20.0)
    rate = capacity * args.factor
    print(f"capacity {capacity:.1f} req/s; offering {rate:.1f} req/s for {args.duration:.0f} s", flush=True)
    tally: Counter = Counter()
    samples: list[dict] = []
    stop = asyncio.Event()
    watch = asyncio.create_task(sampler(d, samples, stop))
    started = time.monotonic()
    load = asyncio.create_task(open_loop(url, args.tokens, Offered(rate, args.duration, args.abandon), tally))
    while not load.done():  # the samples of the overload itself, not of its tail
        await asyncio.sleep(1.0)
        if time.monotonic() - started >= args.duration:
            stop.set()
    achieved = await load
    stop.set()
    await watch
    released = await asyncio.to_thread(release_time, d)
    queued = [s["queued"] for s in samples if s["queued"] == s["queued"]]
    return {
        "matmul_gflops": round(gflops, 1),
        "capacity_rps": round(capacity, 2),
        "offered_rps": round(rate, 1),
        "achieved_rps": round(achieved, 1),
        "requests": sum(tally.values()),
        "ended": dict(tally.most_common()),
        "hung": tally["hung"],
        "max_queued_tasks": max(queued, default=0),
        "max_in_flight": max((s["in_flight"] for s in samples), default=0),
        "released_s": None if released is None else round(released, 1),
        "memory": memory(samples),
        "samples": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=10.0, help="offered load over measured capacity")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of overload")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per request (ignore_eos)")
    parser.add_argument("--abandon", type=float, default=0.3, help="share of clients that leave early")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir; default: the tiny model")
    parser.add_argument("--workdir", type=Path, default=Path(".trident/overload"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = model_or_tiny(args.model, args.workdir)
    d = LocalUp(UpCommand(model, args.workdir, scale=ONE, env={"TRIDENT_REQUEST_TIMEOUT": str(DEADLINE)}))
    try:
        d.wait_whole(300)
        result = asyncio.run(run(d, args))
    finally:
        d.stop()
    # Trident's own processes must stay flat; NATS and Redis keep a bounded history that grows
    # towards its caps (request records, the trace), reported beside them.
    growth = {n: m["growth"] for n, m in result["memory"].items() if n not in SERVERS}
    result["goals_met"] = (
        result["hung"] == 0
        and all(g < FLAT for g in growth.values())
        and result["released_s"] is not None
        and result["released_s"] <= RELEASE_GOAL
    )
    print()
    print("process | first third MiB | last third MiB | growth")
    print("--- | --- | --- | ---")
    for name, m in result["memory"].items():
        print(f"{name} | {m['first_mib']} | {m['last_mib']} | {m['growth']:+.1%}")
    queued, released = result["max_queued_tasks"], result["released_s"]
    print(f"ended: {result['ended']}; most queued tasks {queued:.0f}; all released after {released} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
