"""Faults under a steady streaming load: does every request still end, with the right answer?

    python bench/faults.py [--faults kill-decoder,nats-outage,...] [--streams 4] [--tokens 128]
                           [--settle 8] [--outage 20] [--freeze 10] [--deadline 60]
                           [--model DIR] [--workdir .trident/faults] [--ha]
    python bench/faults.py --ha --faults none,nats-node-kill,redis-primary-kill

Runs `trident up` (E+P+D, two replicas of each stage, the tiny model by default) as a user would,
and puts it under `--streams` greedy streaming clients that ask one chat after another (half of
the chats with an image). Each fault, one after another on the same deployment:

- kill-encoder, kill-prefill, kill-decoder, kill-gateway: `kill -9` of one process (a decoder that
  holds streams); `trident up` restarts it, as compose's `restart: unless-stopped` would;
- term-encoder, ... term-gateway: SIGTERM (a drain), then the same restart;
- nats-restart, redis-restart: `kill -9` of the server; `trident up` starts it again at once on the
  same port and files;
- nats-outage: nats-server killed and kept down for `--outage` seconds (the launcher is paused
  meanwhile so it does not restart it);
- freeze-decoder: SIGSTOP of a decoder holding streams for `--freeze` seconds, then SIGCONT; it
  finds it was taken for dead and leaves (exit 3), and is restarted;
- nats-node-kill, redis-primary-kill (with `--ha`: a three-node NATS cluster, and a Redis primary
  with a replica behind three sentinels): `kill -9` of the NATS node that leads the task stream, or
  of the Redis primary; the others carry on (a new stream leader, the replica promoted) and
  `trident up` restarts the dead one, which rejoins (the old primary as a replica);
- none: no fault, the same load: what "normal" looks like.

For each: requests accepted; completed with HF-identical greedy text; ended with a clear error;
hung (no end within `--deadline`, which is also the gateway's TRIDENT_REQUEST_TIMEOUT minus 15 s
of slack); lost (finished with other text); retried (the connection was refused or cut, and the
client asked again: only a gateway's death does that); the longest stall a client saw (seconds
without a new token, the first one included). After each fault the deployment must be whole again
(two of each stage registered, the gateway ready) before the next one. A table goes to stdout and
the figures as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trident.bench.client import image_data_url
from trident.bench.fault_load import Outcome, StreamingLoad
from trident.bench.machine import matmul_gflops
from trident.bench.oracle import Chat, hf_greedy
from trident.launcher.local_up import LocalUp, UpCommand, model_or_tiny

STAGES = ("encoder", "prefill", "decode")  # the compose services scaled to REPLICAS
WORKERS = {"encoder": "encode", "prefill": "prefill", "decoder": "decode"}  # fault name -> role
REPLICAS = 2
WARM = 4.0  # seconds of load before the fault, so streams are under way when it strikes
# Single-process deaths and restarts: every request must complete with identical text.
HA_FAULTS = {"nats-node-kill", "redis-primary-kill"}  # with --ha only
MUST_COMPLETE = {
    *(f"{how}-{s}" for how in ("kill", "term") for s in [*WORKERS, "gateway"]),
    "nats-restart",
    "redis-restart",
    *HA_FAULTS,
}
# A live replica (of a stage, a NATS node, the Redis primary) takes over: stall ≤ 3 s.
FAILOVER = {"kill-encoder", "kill-prefill", "kill-decoder", *HA_FAULTS}
STALL_GOAL = 3.0
ALL_FAULTS = ["none", *sorted(MUST_COMPLETE - HA_FAULTS), "nats-outage", "freeze-decoder"]
SINGLE_SERVER = {"nats-restart", "redis-restart", "nats-outage"}  # not with --ha


# -- the faults --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    name: str
    strike: Callable[[LocalUp], Callable[[], None] | None]  # returns what ends it, if anything
    hold: float = 0.0  # seconds between the strike and its end


def signal_worker(role: str, signum: int) -> Callable[[LocalUp], None]:
    return lambda d: os.kill(d.busy_worker(role), signum)


def signal_service(service: str, signum: int) -> Callable[[LocalUp], None]:
    return lambda d: os.kill(d.pid(service), signum)


def outage(d: LocalUp) -> Callable[[], None]:
    os.kill(d.proc.pid, signal.SIGSTOP)  # the launcher would restart nats at once
    os.kill(d.pid("nats"), signal.SIGKILL)
    return lambda: os.kill(d.proc.pid, signal.SIGCONT)


def freeze(d: LocalUp) -> Callable[[], None]:
    pid = d.busy_worker("decode")
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


def faults(outage_s: float, freeze_s: float) -> dict[str, Fault]:
    found = {"none": Fault("none", lambda d: None)}
    for how, signum in (("kill", signal.SIGKILL), ("term", signal.SIGTERM)):
        for name, role in WORKERS.items():
            found[f"{how}-{name}"] = Fault(f"{how}-{name}", signal_worker(role, signum))
        found[f"{how}-gateway"] = Fault(f"{how}-gateway", signal_service("gateway", signum))
    found["nats-restart"] = Fault("nats-restart", signal_service("nats", signal.SIGKILL))
    found["redis-restart"] = Fault("redis-restart", signal_service("redis", signal.SIGKILL))
    found["nats-node-kill"] = Fault("nats-node-kill", lambda d: os.kill(d.stream_leader(), signal.SIGKILL))
    found["redis-primary-kill"] = Fault(
        "redis-primary-kill", lambda d: os.kill(d.redis_primary(), signal.SIGKILL)
    )
    found["nats-outage"] = Fault("nats-outage", outage, hold=outage_s)
    found["freeze-decoder"] = Fault("freeze-decoder", freeze, hold=freeze_s)
    return found


# -- one run -----------------------------------------------------------------------------------------
def run_fault(d: LocalUp, load: StreamingLoad, fault: Fault, settle: float) -> list[Outcome]:
    load.start()
    time.sleep(WARM)
    end = fault.strike(d)
    time.sleep(fault.hold)
    if end is not None:
        end()
    time.sleep(settle)
    return load.stop()


def summary(name: str, outcomes: list[Outcome], recovered: float) -> dict:
    count = {s: sum(o.status == s for o in outcomes) for s in ("identical", "different", "error", "hung")}
    errors = sorted({o.error for o in outcomes if o.status == "error"})
    return {
        "fault": name,
        "requests": len(outcomes),
        "accepted": sum(o.accepted for o in outcomes),
        "identical": count["identical"],
        "error": count["error"],
        "hung": count["hung"],
        "lost": count["different"],
        "retried": sum(o.attempts > 1 for o in outcomes),
        "stall_s": round(max((o.stall for o in outcomes), default=0.0), 2),
        "recovered_s": round(recovered, 1),
        "errors": errors[:5],
    }


def goals(row: dict) -> list[str]:
    """The goals a fault's row misses (none: met)."""
    missed = []
    if row["hung"] or row["lost"]:
        missed.append("hung or lost requests")
    if row["fault"] in MUST_COMPLETE and row["identical"] != row["requests"]:
        missed.append("not every request completed identically")
    if row["fault"] in FAILOVER and row["stall_s"] > STALL_GOAL:
        missed.append(f"stall over {STALL_GOAL:.0f} s")
    return missed


def chats() -> list[Chat]:
    size = (320, 240)
    return [
        Chat("Tell me a story about a lighthouse."),
        Chat("What is in the picture?", (image_data_url(11, size),)),
        Chat("Write a poem about the sea and the wind."),
        Chat("Describe this image in detail.", (image_data_url(12, size),)),
        Chat("List some things to do on a rainy day."),
        Chat("What colours do you see here?", (image_data_url(13, size),)),
    ]


def table(rows: list[dict]) -> str:
    cols = ["fault", "accepted", "identical", "error", "hung", "lost", "retried", "stall_s", "recovered_s"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for row in rows:
        cells = [str(row[c]) for c in cols]
        lines.append(" | ".join(cells) + ("" if not row["missed"] else "  <- " + "; ".join(row["missed"])))
    return "\n".join(lines)


def parse_args() -> tuple[argparse.Namespace, list[Fault]]:
    """The flags, and the faults they name, in order; a usage error for one unknown or not for this
    deployment."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(ALL_FAULTS), help="comma-separated, in order")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per request (ignore_eos)")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of load after a fault ends")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds NATS stays down")
    parser.add_argument("--freeze", type=float, default=10.0, help="seconds a decoder stays frozen")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds after which a request is hung")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir; default: the tiny model")
    parser.add_argument("--workdir", type=Path, default=Path(".trident/faults"))
    parser.add_argument(
        "--ha", action="store_true", help="trident up --ha: a NATS cluster, Redis behind sentinels"
    )
    args = parser.parse_args()
    table_of = faults(args.outage, args.freeze)
    chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in table_of]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join([*ALL_FAULTS, *sorted(HA_FAULTS)])}")
    wrong = sorted(set(chosen) & (SINGLE_SERVER if args.ha else HA_FAULTS))
    if wrong:
        parser.error(f"{wrong} need {'a single NATS and Redis (no --ha)' if args.ha else '--ha'}")
    return args, [table_of[name] for name in chosen]


def main() -> None:
    args, chosen = parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = model_or_tiny(args.model, args.workdir)
    asked = chats()
    expected = hf_greedy(model, asked, args.tokens)
    rate = matmul_gflops()
    print(
        f"matmul: {rate:.1f} GFLOP/s (fp32 1024x1024); {len(asked)} chats, HF references computed", flush=True
    )
    scale = {service: REPLICAS for service in STAGES}
    env = {"TRIDENT_REQUEST_TIMEOUT": str(args.deadline + 15)}
    d = LocalUp(UpCommand(model, args.workdir, scale=scale, env=env, ha=args.ha))
    try:
        d.wait_whole(300)
        load = StreamingLoad(d.url, model.name, asked, expected, args.tokens, args.streams, args.deadline)
        rows = [strike(d, load, fault, args.settle) for fault in chosen]
    finally:
        d.stop()
    print()
    print(table(rows))
    met = all(not row["missed"] for row in rows)
    figures = {"matmul_gflops": round(rate, 1), "streams": args.streams, "tokens": args.tokens, "ha": args.ha}
    print(json.dumps({**figures, "goals_met": met, "faults": rows}))


def strike(d: LocalUp, load: StreamingLoad, fault: Fault, settle: float) -> dict:
    """One fault under load, and its row once the deployment is whole again."""
    outcomes = run_fault(d, load, fault, settle)
    recovered = d.wait_whole(240)
    row = summary(fault.name, outcomes, recovered)
    row["missed"] = goals(row)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
