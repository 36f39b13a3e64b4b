"""Where a deployment's time goes under load: each process's share of the cores, what its Python
spends them on, and which stage holds the time of the requests whose TTFT stands out.

    python bench/process_profile.py [--model DIR] [--method ep+d] [--rate 0.7] [--duration 60]
                                    [--py-spy]

Starts `trident up` as `trident bench compare` does and sends one rate of the TextCaps-shaped load
(336×336 images, 64 output tokens, each request's own image and prompt). Meanwhile it reads every
process's CPU time and threads from /proc — the servers, the gateway, each worker, the planner and
its jobs worker, and this client — and, with `--py-spy`, samples each Python process with py-spy
(the `bench` extra installs it) for its functions by own time.

Afterwards it reads every request's stage marks (Redis, the trace stream) and splits its TTFT as
the gateway measured it into the intervals between consecutive marks, arrival to first token,
plus what the gateway spent outside them (reading and preprocessing the request before its
arrival mark, the first token's way back out). For the requests whose TTFT is over twice the
median, each interval stands beside the median request's, so the one that holds the time shows.

A table goes to stdout, and the figures as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.secrets import DeploymentSecrets, with_credentials
from common.store import Stage, Store, StoreConfig
from trident.bench import client, deployments
from trident.bench.machine import single_thread_gflops
from trident.bench.sweep import LoadSpec
from trident.launcher.local_up import UpCommand, state_processes

TICKS = os.sysconf("SC_CLK_TCK")
PATH = [s.value for s in Stage]  # the marks in path order


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds, threads) of a live process; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, int(fields[17])


def cpu_by_process(roots: dict[str, int], skip: set[int] = frozenset()) -> dict[str, dict]:
    """Each named process with its descendants: CPU seconds so far and threads now. A descendant
    that is named itself counts under its own name, and one in `skip` (the profiler) nowhere."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {}
    for name, root in roots.items():
        tree, cpu, threads = [root], 0.0, 0
        while tree:
            pid = tree.pop()
            if pid in skip or (pid != root and pid in roots.values()):
                continue
            if pid in table:
                cpu += table[pid][1]
                threads += table[pid][2]
                tree += children.get(pid, [])
        found[name] = {"pid": root, "cpu_s": cpu, "threads": threads}
    return found


def processes(state: dict) -> dict[str, int]:
    """The pid of every server and service `trident up` started (its state file), and this client."""
    return {**state_processes(state), "client (this process)": os.getpid()}


def start_py_spy(pids: dict[str, int], seconds: float, out: Path) -> dict[str, subprocess.Popen]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise SystemExit("--py-spy needs py-spy: pip install -e '.[bench]'")
    spies = {}
    for name, pid in pids.items():
        if name in ("nats", "redis", "trident up"):
            continue  # not Python, or idle
        argv = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50",
                "--format", "raw", "--nonblocking", "--output", str(out / f"{name}.txt")]  # fmt: skip
        spies[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return spies


def own_time(raw: Path, top: int = 6) -> list[tuple[str, float]]:
    """The functions a py-spy raw profile saw running themselves, by share of its samples."""
    counts: Counter = Counter()
    for line in raw.read_text().splitlines() if raw.exists() else ():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stack.split(";")[-1].strip()] += int(n)
    total = sum(counts.values()) or 1
    return [(frame, round(n / total, 3)) for frame, n in counts.most_common(top)]


async def trace_records(redis_url: str, expected: int, timeout: float = 30.0) -> list:
    """Every finished request's trace record, once `expected` of them are in (or `timeout`)."""
    store = await Store.connect(StoreConfig(url=redis_url))
    try:
        deadline = time.monotonic() + timeout
        while True:
            records = [r for _, r in await store.requests.trace(after="-", count=100_000)]
            if len(records) >= expected or time.monotonic() > deadline:
                return records
            await asyncio.sleep(0.5)
    finally:
        await store.close()


def intervals(stages: dict[str, float], ttft: float | None) -> dict[str, float]:
    """A request's TTFT in ms, between consecutive marks from arrival to its first token, and the
    gateway's part outside them ("gateway": its TTFT less first token minus arrival)."""
    marks = [(name, stages[name]) for name in PATH[: PATH.index("first_token") + 1] if name in stages]
    found = {f"{a}→{b}": round((tb - ta) * 1000, 1) for (a, ta), (b, tb) in itertools.pairwise(marks)}
    if ttft is not None and "arrival" in stages and "first_token" in stages:
        found["gateway"] = round((ttft - (stages["first_token"] - stages["arrival"])) * 1000, 1)
    return found


def outliers(records: list, factor: float = 2.0) -> dict:
    """The median request's intervals, and those of each request whose TTFT is over `factor` × the
    median, with its arrival (s from the first) and how many requests arrived in the second before."""
    timed = [r for r in records if r.ttft is not None]
    if not timed:
        return {"median_ttft_ms": None, "median": {}, "outliers": []}
    median_ttft = statistics.median(r.ttft for r in timed)
    split = [intervals(r.stages, r.ttft) for r in timed]
    names = sorted(
        {k for s in split for k in s}, key=lambda k: PATH.index(k.split("→")[0]) if "→" in k else -1
    )
    median = {k: round(statistics.median(s[k] for s in split if k in s), 1) for k in names}
    first = min(r.arrival for r in timed)
    found = []
    for r, s in zip(timed, split, strict=True):
        if r.ttft > factor * median_ttft:
            before = sum(1 for o in timed if r.arrival - 1.0 <= o.arrival < r.arrival)
            found.append(
                {
                    "ttft_ms": round(r.ttft * 1000, 1),
                    "arrival_s": round(r.arrival - first, 2),
                    "arrived_in_the_second_before": before,
                    "images": r.num_images,
                    "prompt_tokens": r.prompt_tokens,
                    "intervals": s,
                }
            )
    return {"median_ttft_ms": round(median_ttft * 1000, 1), "median": median, "outliers": found}


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    load = LoadSpec(
        rates=(args.rate,), duration=args.duration, workload="textcaps", seed=args.seed, max_output_tokens=64
    )
    entries = load.entries(args.rate)
    with deployments.trident(UpCommand(args.model, workdir, args.method)) as served:
        opts = client.RequestOptions(model=served.model, image_size=(336, 336), seed=args.seed)
        asyncio.run(client.run(served.url, entries[:2], opts))  # warm: not measured
        state = json.loads((workdir / ".trident" / "up.json").read_text())
        names = {**processes(state), "trident up": served.pid}
        spies = start_py_spy(names, args.duration, workdir) if args.py_spy else {}
        skip = {spy.pid for spy in spies.values()}
        before, started = cpu_by_process(names, skip), time.monotonic()
        opts = client.RequestOptions(model=served.model, image_size=(336, 336), seed=args.seed + 1)
        results = asyncio.run(client.run(served.url, entries, opts))
        wall, after = time.monotonic() - started, cpu_by_process(names, skip)
        for spy in spies.values():
            spy.wait(60)
        password = DeploymentSecrets.read(Path(state["secrets"])).redis_password
        redis_url = with_credentials(state["servers"]["redis"]["url"], "", password)
        records = asyncio.run(trace_records(redis_url, len(entries) + 2))
    cores = len(os.sched_getaffinity(0))
    done = [r for r in results if r.ok]
    table = {}
    for name, a in after.items():
        cpu = a["cpu_s"] - before[name]["cpu_s"]
        table[name] = {
            "cpu_s": round(cpu, 2),
            "share_of_cores": round(cpu / (wall * cores), 3),
            "cpu_ms_per_request": round(1000 * cpu / max(len(done), 1), 1),
            "threads": a["threads"],
            "py_spy": own_time(workdir / f"{name}.txt") if args.py_spy else [],
        }
    return {
        "method": args.method,
        "rate": args.rate,
        "requests": len(entries),
        "ok": len(done),
        "wall_s": round(wall, 1),
        "cores": cores,
        "processes": table,
        "ttft": outliers(sorted(records, key=lambda r: r.arrival)[2:]),  # the two warm-up requests out
    }


def print_report(report: dict) -> None:
    print(
        f"{report['method']} at {report['rate']} req/s: {report['ok']}/{report['requests']} requests "
        f"in {report['wall_s']} s on {report['cores']} cores"
    )
    print(f"{'process':<24}{'CPU s':>8}{'cores %':>9}{'ms/req':>8}{'threads':>8}  own time (py-spy)")
    for name, p in sorted(report["processes"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        top = ", ".join(f"{f} {s:.0%}" for f, s in p["py_spy"][:3])
        print(
            f"{name:<24}{p['cpu_s']:>8.1f}{100 * p['share_of_cores']:>8.1f}%"
            f"{p['cpu_ms_per_request']:>8.0f}{p['threads']:>8}  {top}"
        )
    t = report["ttft"]
    print(f"\nTTFT median {t['median_ttft_ms']} ms; its intervals (ms): {t['median']}")
    for o in t["outliers"]:
        over = {k: v for k, v in o["intervals"].items() if v > 2 * t["median"].get(k, 0) + 20}
        print(
            f"  {o['ttft_ms']} ms at {o['arrival_s']} s ({o['arrived_in_the_second_before']} arrived in "
            f"the second before, {o['images']} image(s)): over the median in {over}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".trident/models/small-llava"))
    parser.add_argument(
        "--preset", default="small-llava", help="written to --model if it holds no checkpoint"
    )
    parser.add_argument("--method", default="ep+d")
    parser.add_argument("--rate", type=float, default=0.7, help="requests/s (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--py-spy", action="store_true", help="sample each Python process's functions")
    args = parser.parse_args()
    if not is_checkpoint_dir(args.model):
        write_checkpoint(args.model, preset=args.preset)
    gflops = single_thread_gflops()
    with tempfile.TemporaryDirectory(prefix="trident-profile-") as tmp:
        report = measure(args, Path(tmp))
    report["matmul_gflops"] = round(gflops, 1)
    print_report(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
